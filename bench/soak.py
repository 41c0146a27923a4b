"""Soak: a few hundred concurrent streams for several minutes against a local cluster, with random cancels.

    .venv/bin/python -m bench.soak                       # `make soak`: ~5 minutes on a cluster it starts
    .venv/bin/python -m bench.soak --duration 45         # a short run while developing
    .venv/bin/python -m bench.soak --target 127.0.0.1:50051 --coordinator 127.0.0.1:50061 \\
        --stage-addresses 127.0.0.1:50071,127.0.0.1:50072 --pids stage0=PID,stage1=PID,...

Every request is classified against the single-request reference (bench/soak_load.py); every service's RSS
is sampled over the run and must stay flat; once the load is gone every stage must hold nothing. It exits 1
on any WRONG or HUNG request, RSS growth past the tolerance, a refusal without RetryInfo, a service that
exited, or state left behind. It only ever talks to 127.0.0.1 (--target included), and every loop and every
call ends by itself: sending stops at --duration, every call has a --request-timeout deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

from bench.soak_load import CANCELLED, CLASSES, EXACT, REFUSED, LoadSpec, Tally, run_load
from bench.soak_pool import Combo, build_pool
from bench.soak_report import failures, summary
from bench.soak_watch import RssSampler, service_state, wait_drained
from tether import reference
from tether.cli.cluster import LocalCluster
from tether.client import AsyncClient

PROGRESS_EVERY_S = 10.0
START_TIMEOUT_S = 300.0
LOOPBACK = ("127.0.0.1", "localhost")


def _pairs(text: str) -> dict[str, int]:
    """'stage0=123,admission=456' -> {'stage0': 123, 'admission': 456}"""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, pid = part.partition("=")
        if not pid.isdigit():
            raise argparse.ArgumentTypeError(f"expected NAME=PID, got {part!r}")
        out[name] = int(pid)
    return out


def _loopback(address: str) -> str:
    # A soak floods what it targets: it is for a cluster on this machine, never one reached over a network.
    if address.rpartition(":")[0] not in LOOPBACK:
        raise argparse.ArgumentTypeError(f"the soak only talks to 127.0.0.1; got {address!r}")
    return address


def _loopbacks(text: str) -> list[str]:
    return [_loopback(a.strip()) for a in text.split(",") if a.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__,
        description="Soak a tether cluster: N closed-loop streaming clients for a while (mixed prompt lengths and\n"
                    "max_tokens, greedy and seeded sampling, some cancelled mid-stream, admission's cap low enough\n"
                    "to refuse some), every answer checked against the in-process reference, the RSS of every\n"
                    "service sampled, the stages checked for leftover state at the end.")
    g = p.add_argument_group("cluster")
    g.add_argument("--target", type=_loopback, metavar="HOST:PORT",
                   help="attach to a running cluster's admission instead of starting one (then --coordinator, "
                        "--stage-addresses and --pids say what to watch)")
    g.add_argument("--coordinator", type=_loopback, metavar="HOST:PORT",
                   help="with --target: the coordinator, for its Stats")
    g.add_argument("--stage-addresses", type=_loopbacks, metavar="HOST:PORT,...", default=[],
                   help="with --target: every stage, for requests_held and kv_used_tokens at the end")
    g.add_argument("--pids", type=_pairs, default={}, metavar="NAME=PID,...",
                   help="with --target: the service processes whose RSS to sample")
    # tiny: the soak checks the service (streams, cancels, leaks), not the model; the real one would need ~20x the CPU.
    g.add_argument("--model", default="tiny", help="served model (default: %(default)s)")
    g.add_argument("--stages", type=int, default=2, help="stages to start (default: %(default)s)")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads per stage (default: cores divided among the stages, as `tether up`)")
    g.add_argument("--max-concurrent", type=int, default=128,
                   help="admission's concurrency cap for the cluster it starts: below --concurrency, so some "
                        "requests are refused (default: %(default)s)")
    g.add_argument("--log-dir", type=Path, default=Path("bench-out/soak/logs"),
                   help="service logs of the cluster it starts (default: %(default)s)")
    g = p.add_argument_group("load")
    g.add_argument("--duration", type=float, default=300.0, help="seconds of load (default: %(default)s)")
    g.add_argument("--concurrency", type=int, default=256, help="concurrent streaming clients (default: %(default)s)")
    g.add_argument("--cancel-fraction", type=float, default=0.1,
                   help="share of requests cancelled at a random token (default: %(default)s)")
    g.add_argument("--pool", type=int, default=36,
                   help="distinct (prompt, sampling) combinations (default: %(default)s)")
    g.add_argument("--max-prompt-tokens", type=int, default=320, help="longest prompt (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=240.0,
                   help="every call's deadline; a request without a status by then is HUNG. Generous: 128 admitted "
                        "requests share a few hundred tok/s on 2 cores, so a 200-token answer can take a minute "
                        "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seeds the pool and every client (default: %(default)s)")
    g = p.add_argument_group("checks and output")
    g.add_argument("--rss-interval", type=float, default=3.0, help="seconds between RSS samples (default: %(default)s)")
    g.add_argument("--rss-tolerance", type=float, default=0.10,
                   help="allowed RSS growth of any service after the warm-up: its peak against its RSS then "
                        "(default: %(default)s)")
    g.add_argument("--warmup", type=float, default=60.0, metavar="SECONDS",
                   help="seconds of load after which RSS must hold (a third of --duration when that is shorter than "
                        "two warm-ups) (default: %(default)s)")
    g.add_argument("--drain-timeout", type=float, default=10.0,
                   help="seconds to wait for the stages to hold nothing after the load (default: %(default)s)")
    g.add_argument("--out", type=Path, default=Path("bench-out/soak/report.json"),
                   help="JSON report (default: %(default)s)")
    g.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


async def _progress(tally: Tally, t0: float, duration_s: float) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        counts = ", ".join(f"{c} {n}" for c, n in sorted(tally.counts.items()))
        print(f"soak {time.monotonic() - t0:5.0f}/{duration_s:g} s: {counts}", file=sys.stderr, flush=True)


async def _check_model(target: str, pool: list[Combo], model: str) -> None:
    """One unary request first: the receipt says which model answers, and the references are only valid for ours."""
    async with AsyncClient(target, timeout=60, retry=None) as client:
        r = await client.generate(pool[0].request.prompt, **pool[0].request.params())
    want = reference.load(model).served_fingerprint
    if r.receipt.model_fingerprint != want:
        raise SystemExit(f"soak: {target} serves model {r.receipt.model_fingerprint}, --model {model} is {want}")


async def soak(args: argparse.Namespace, target: str, stages: dict[str, str], coordinator: str | None,
               pids: dict[str, int]) -> dict:
    """The whole run against `target`; returns the report (failures included)."""
    async with AsyncClient(target, timeout=60, retry=None) as client:
        pool = await build_pool(client, args.model, args.pool, args.seed, args.max_prompt_tokens)
    await _check_model(target, pool, args.model)
    state_before = await service_state(stages, coordinator)
    tally = Tally()
    sampler = RssSampler(pids, args.rss_interval)
    t0 = time.monotonic()
    sampler.start()
    progress = None if args.quiet else asyncio.create_task(_progress(tally, t0, args.duration))
    spec = LoadSpec(args.concurrency, args.duration, args.cancel_fraction, args.request_timeout, args.seed)
    deadline = await run_load(target, pool, spec, tally)
    t_end = time.monotonic()
    if progress is not None:
        progress.cancel()
    await sampler.stop()
    sampler.sample()          # catches a process that exited during the last interval
    if stages or coordinator:
        drained, waited, state = await wait_drained(stages, coordinator, args.drain_timeout)
    else:     # attached without --stage-addresses or --coordinator: nothing to ask
        drained, waited, state = None, 0.0, dict(stages={})
    wall = t_end - t0
    by_class = {c: tally.counts.get(c, 0) for c in CLASSES}
    report = dict(
        meta=dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                  command=shlex.join(["python", "-m", "bench.soak", *sys.argv[1:]]), target=target,
                  spawned=args.target is None,
                  model=args.model, stages=len(stages) or args.stages, concurrency=args.concurrency,
                  duration_s=args.duration, cancel_fraction=args.cancel_fraction,
                  max_concurrent=args.max_concurrent if args.target is None else None, pool_size=len(pool),
                  request_timeout_s=args.request_timeout, cpus=os.cpu_count(), load_average_end=os.getloadavg()),
        pool=[c.describe() for c in pool],
        requests=dict(total=tally.total, by_class=by_class, errors_by_code=dict(tally.errors_by_code),
                      cancelled_before_first_token=tally.cancelled_before_first_token,
                      refused_without_retry_info=tally.refused_without_retry_info, examples=tally.examples),
        throughput=dict(wall_s=round(wall, 2), sending_s=round(deadline - t0, 2),
                        drain_after_deadline_s=round(max(0.0, t_end - deadline), 2),
                        exact_per_s=round(by_class[EXACT] / wall, 3),
                        exact_output_tokens_per_s=round(tally.exact_tokens / wall, 1),
                        delivered_tokens_per_s=round((tally.exact_tokens + tally.cancelled_tokens) / wall, 1),
                        cancelled_per_s=round(by_class[CANCELLED] / wall, 3),
                        refused_per_s=round(by_class[REFUSED] / wall, 3)),
        rss=dict(tolerance=args.rss_tolerance, interval_s=args.rss_interval, warmup_s=args.warmup,
                 services=sampler.flatness(t0, deadline, args.warmup)),
        services_exited=sorted(sampler.exited),
        state_before=state_before,
        state_after=dict(drained=drained, waited_s=waited, state=state),
    )
    report["failures"] = failures(report)
    return report


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cluster = None
    if args.target is None:
        threads = args.threads or max(1, (os.cpu_count() or 1) // args.stages)
        cluster = LocalCluster(model=args.model, stages=args.stages, threads=threads, log_dir=args.log_dir,
                               extra={"admission": ["--max-concurrent", str(args.max_concurrent)]})
        print(f"soak: starting {args.model} with {args.stages} stages (logs in {args.log_dir}) ...", file=sys.stderr)
        cluster.start(timeout=START_TIMEOUT_S)
        target = cluster.target
        stages = {s.name: s.address for s in cluster.services if s.name.startswith("stage")}
        coordinator: str | None = cluster.service("coordinator").address
        pids = {s.name: s.proc.pid for s in cluster.services}
    else:
        target, coordinator, pids = args.target, args.coordinator, args.pids
        stages = {f"stage{i}": a for i, a in enumerate(args.stage_addresses)}
    try:
        report = asyncio.run(soak(args, target, stages, coordinator, pids))
    finally:
        if cluster is not None:
            cluster.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(summary(report))
    print(f"report: {args.out}")
    sys.exit(1 if report["failures"] else 0)


if __name__ == "__main__":
    main()
