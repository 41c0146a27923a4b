"""Memory under many short requests: every service's RSS after 1,000 and after 10,000 completed requests.

    .venv/bin/python -m bench.memory                          # `make bench-memory`: tiny, 2 stages, ~minutes
    .venv/bin/python -m bench.memory --checkpoints 200,1000   # a short run while developing
    .venv/bin/python -m bench.memory --no-prefix-cache        # the same without the prefix cache (issue 11)

A cluster is started on loopback; closed-loop clients send short synthetic requests (distinct prompts, so the
prefix cache keeps filling and must evict) until each checkpoint's count of requests has completed; at each
checkpoint, with the load paused, it reads every service's RSS (/proc VmRSS, worker processes included), its
CPU busy fraction since the last checkpoint, and the engine's Stats (KV blocks, prefix cache). The stages' RSS
at the last checkpoint must be within --tolerance (10%) of the first; it exits 1 otherwise, or when a
request failed or a service exited. Every loop is bounded by the checkpoint counts and every call by
--timeout.
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

from tether import reference
from tether.loadtest import cluster_stats, loadgen
from tether.loadtest.workloads import SyntheticSpec, Workload, parse_mix
from tether.cli.cluster import LocalCluster
from tether.client import AsyncClient

START_TIMEOUT_S = 300.0


def _checkpoints(text: str) -> list[int]:
    try:
        points = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected increasing counts like 1000,10000; got {text!r}") from None
    if not points or points[0] < 1 or any(b <= a for a, b in zip(points, points[1:])):
        raise argparse.ArgumentTypeError(f"expected increasing positive counts like 1000,10000; got {text!r}")
    return points


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="model the cluster serves (default: %(default)s)")
    p.add_argument("--stages", type=int, default=2, help="stage workers (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per stage (default: cores ÷ stages)")
    p.add_argument("--checkpoints", type=_checkpoints, default=[1000, 10000], metavar="N,N,...",
                   help="completed-request counts at which RSS is read (default: 1000,10000)")
    p.add_argument("--warmup", type=int, default=100, help="requests before counting starts (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop clients (default: %(default)s)")
    p.add_argument("--workload", type=parse_mix, default=parse_mix("synthetic"),
                   help="bench workload mix (default: synthetic)")
    # Longer than the stages' KV block (64 tokens by default): shorter prompts leave no full block to cache, and
    # the prefix cache's memory would go unmeasured.
    p.add_argument("--input-len", type=int, default=100, help="synthetic prompt tokens, mean (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=4, help="synthetic output tokens, mean (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request deadline in s (default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="largest allowed stage RSS growth, first checkpoint to last (default: %(default)s)")
    p.add_argument("--no-prefix-cache", action="store_true", help="start the coordinator with --no-prefix-cache")
    # The cache keeps freed blocks, so a stage's pool fills with cached blocks and its arena grows (by doubling)
    # to the pool's capacity: RSS rises by the pool's size, then stays. A small pool is full long before the first
    # checkpoint, so growth after it is a leak, not the pool filling; --stage-kv-tokens 0 keeps the stages' own.
    p.add_argument("--stage-kv-tokens", type=int, default=16384,
                   help="each stage's --kv-capacity in tokens, 0 for the stages' default (default: %(default)s, "
                        "a pool full of cached blocks before the first checkpoint)")
    p.add_argument("--out", type=Path, default=Path("bench-out/memory/report.json"), help="report (JSON)")
    p.add_argument("--log-dir", type=Path, default=Path("bench-out/memory/logs"), help="service logs")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def growth(first: int | None, last: int | None) -> float | None:
    """last / first - 1 (RSS growth between two checkpoints); None when either is unknown."""
    if not first or last is None:
        return None
    return last / first - 1


def verdict(rss_kib: dict[str, list[int | None]], tolerance: float, failed: int, exited: list[str]) -> list[str]:
    """Why the run fails (empty: it passes): a stage whose RSS grew past `tolerance` from the first checkpoint to
    the last, failed requests, services that exited."""
    problems = []
    for name, series in rss_kib.items():
        g = growth(series[0], series[-1])
        if name.startswith("stage") and "/" not in name and (g is None or g > tolerance):
            problems.append(f"{name} RSS grew {'?' if g is None else f'{100 * g:+.1f}%'} (limit {100 * tolerance:g}%)")
    if failed:
        problems.append(f"{failed} request(s) failed")
    problems += [f"{name} exited" for name in exited]
    return problems


async def drive(args: argparse.Namespace, cluster: LocalCluster, workload: Workload) -> dict:
    services = {s.name: s.proc.pid for s in cluster.services if s.proc is not None}
    stages = [s.address for s in cluster.services if s.name.startswith("stage")]
    coordinator = cluster.service("coordinator").address
    requests = workload.stream(f"{args.seed}:memory")
    level = loadgen.Level("closed", concurrency=args.concurrency)
    checkpoints: list[dict] = []
    failed: dict[str, int] = {}
    done = 0
    async with AsyncClient(cluster.target, timeout=args.timeout, retry=None) as client:
        await loadgen.closed_loop(client, requests, loadgen.Level("closed", concurrency=min(4, args.concurrency)),
                                  loadgen.Budget(num_requests=args.warmup), lambda r: None)
        pids = cluster_stats.with_children(services)
        cpu_before = cluster_stats.read_cpu(pids)
        t0 = time.monotonic()
        for target in args.checkpoints:
            run = await loadgen.closed_loop(client, requests, level, loadgen.Budget(num_requests=target - done),
                                            lambda r: None)
            done = target
            for r in run.records:
                if not r.ok:
                    failed[r.error_code] = failed.get(r.error_code, 0) + 1
            cpu_after = cluster_stats.read_cpu(pids)
            stats = cluster_stats.read_engine(coordinator, stages)
            point = dict(completed=target, pool_fill=pool_fill(stats), elapsed_s=round(time.monotonic() - t0, 1),
                         requests_per_s=round(len(run.records) / run.wall_s, 2),
                         rss_mib={n: None if k is None else round(k / 1024, 1) for n, k in cpu_after["rss_kib"].items()},
                         rss_kib=cpu_after["rss_kib"], cpu=cluster_stats.cpu_delta(cpu_before, cpu_after)["processes"],
                         engine=stats)
            checkpoints.append(point)
            cpu_before = cpu_after
            if not args.quiet:
                stage_rss = ", ".join(f"{n} {v} MiB" for n, v in point["rss_mib"].items() if n.startswith("stage"))
                print(f"{target} completed in {point['elapsed_s']} s ({point['requests_per_s']} req/s): {stage_rss}; "
                      f"{cache_line(stats)}", file=sys.stderr, flush=True)
    names = list(checkpoints[0]["rss_kib"])
    rss = {n: [c["rss_kib"].get(n) for c in checkpoints] for n in names}
    exited = [n for n, s in cluster_exits(cluster).items() if s is not None]
    problems = verdict(rss, args.tolerance, sum(failed.values()), exited)
    return dict(checkpoints=checkpoints, failed_by_status=failed,
                growth={n: None if (g := growth(s[0], s[-1])) is None else round(g, 4) for n, s in rss.items()},
                problems=problems, passed=not problems)


def pool_fill(stats: dict) -> list[float | None]:
    """Per stage: (blocks used + cached) ÷ blocks total; None when unknown (a stage before issue 11)."""
    return [None if not s or not s["kv_blocks_total"] else
            round((s["kv_blocks_used"] + s["kv_blocks_cached"]) / s["kv_blocks_total"], 3) for s in stats["stages"]]


def cache_line(stats: dict) -> str:
    """The stages' prefix-cache state in a few words: blocks cached / total and evictions so far."""
    parts = [f"{s['address']}: {s['kv_blocks_cached']}/{s['kv_blocks_total']} blocks cached, "
             f"{s['prefix_evictions']} evicted, {s['prefix_hits']}/{s['prefix_queries']} hits"
             for s in stats["stages"] if s]
    return "; ".join(parts) or "stage Stats not read"


def cluster_exits(cluster: LocalCluster) -> dict[str, int | None]:
    return {s.name: (s.proc.poll() if s.proc is not None else None) for s in cluster.services}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    lm = reference.load(args.model)
    workload = Workload(args.workload, lm.tokenizer.encode, SyntheticSpec(args.input_len, args.output_len, 0.5))
    extra: dict[str, list[str]] = {}
    if args.stage_kv_tokens:
        extra["stage"] = ["--kv-capacity", str(args.stage_kv_tokens)]
    if args.no_prefix_cache:
        extra["coordinator"] = ["--no-prefix-cache"]
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.stages)
    cluster = LocalCluster(model=args.model, stages=args.stages, threads=threads, log_dir=args.log_dir, extra=extra)
    if not args.quiet:
        flags = "".join(f"; {k} {' '.join(v)}" for k, v in extra.items())
        print(f"starting a cluster: {args.model}, {args.stages} stage(s), {threads} thread(s) each{flags} "
              f"(logs in {args.log_dir}) ...", file=sys.stderr, flush=True)
    try:
        cluster.start(timeout=START_TIMEOUT_S)
    except (TimeoutError, RuntimeError, ValueError) as e:
        cluster.stop()
        print(f"bench.memory: the cluster did not start: {e}", file=sys.stderr)
        return 1
    try:
        result = asyncio.run(drive(args, cluster, workload))
    finally:
        cluster.stop()
    rep = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
               command="python -m bench.memory " + shlex.join(argv), model=args.model, stages=args.stages,
               threads=threads, concurrency=args.concurrency, workload=",".join(args.workload),
               input_len=args.input_len, output_len=args.output_len, extra_flags=extra, tolerance=args.tolerance,
               cores=os.cpu_count(), load_average_end=round(os.getloadavg()[0], 2), **result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rep, indent=2) + "\n", encoding="utf-8")
    first, last = rep["checkpoints"][0], rep["checkpoints"][-1]
    print(f"RSS MiB at {first['completed']} → {last['completed']} completed requests:")
    for name in first["rss_mib"]:
        g = rep["growth"].get(name)
        cpu = last["cpu"].get(name, {}).get("busy_fraction")
        print(f"  {name:28} {first['rss_mib'][name]} → {last['rss_mib'][name]}"
              f"  ({'?' if g is None else f'{100 * g:+.1f}%'}; CPU busy {'?' if cpu is None else f'{cpu:.2f}'})")
    fill = [f for f in first["pool_fill"] if f is not None]
    evicted = [s["prefix_evictions"] for s in first["engine"]["stages"] if s]
    if fill and min(fill) < 0.9 and not all(evicted):     # a pool that has evicted has been full
        print(f"note: the stages' KV pools were {', '.join(f'{100 * f:.0f}%' for f in fill)} full at the first "
              "checkpoint: their growth includes the pool's pages being touched for the first time")
    print("PASS" if rep["passed"] else "FAIL: " + "; ".join(rep["problems"]))
    print(f"report: {args.out}")
    return 0 if rep["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
