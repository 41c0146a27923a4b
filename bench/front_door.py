"""Front door under adversarial prompts: does a small request stall while admission tags hostile text?

    .venv/bin/python -m bench.front_door                       # `make bench-front-door`: a cluster it starts
    .venv/bin/python -m bench.front_door --phase-seconds 4 --rounds 1 --levels 4   # a quick look
    .venv/bin/python -m bench.front_door --target 127.0.0.1:50051                  # a running cluster

Adversarial prompts (number words, repeated units, long digit runs, Chinese numerals, mixed scripts, role
lines, an unclosed <<SYS>>) are built just under the prompt cap and sent by K concurrent clients in a closed
loop with max_tokens=1 (by default through the Tag RPC: all of admission's work, none of generation). Meanwhile
one probe sends a small greedy request (max_tokens=4) every --probe-interval seconds, each followed by a Tag of
the same prompt ("tag p50": admission's share of the small request alone). Idle and loaded phases
alternate (idle, K=4, idle, K=8, idle, K=4, ...) so that the machine's own noise hits both; the figure is
the ratio of the probe's median latency loaded / idle, and the run exits 1 when it exceeds --max-ratio or a
probe request fails. Loopback only; every phase has a fixed duration and every call a --timeout deadline.

--prompts plain sends ordinary prose of the same size instead: the control that tells the cost of hostile text
from the cost of any prompt at the cap. With --via tag the load's calls wait in gRPC's Tag queue, not the
Generate one, so the "tag p50" column is the figure that shows that wait; --via generate adds a 4K-token
prefill per load request, which measures the pipeline rather than the front door.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import multiprocessing
import os
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tether import settings
from tether.loadtest.stats import percentile
from tether.cli.cluster import LocalCluster
from tether.client import AsyncClient, TetherError
from tether.model.loader import load_model_tokenizer, resolve_model

LOOPBACK = ("127.0.0.1", "localhost")
START_TIMEOUT_S = 300.0
PROBE_PROMPT = "Name three primary colours."
PROBE_MAX_TOKENS = 4
ADVERSARIAL_MAX_TOKENS = 1

# name -> (head, repeated unit, tail): each unit repeated until the prompt reaches the byte budget. These are
# the shapes that made the old tagger quadratic: runs a number match could start inside, units after numbers,
# many role lines, and a block that never closes.
KINDS: dict[str, tuple[str, str, str]] = {
    "number_words": ("", "one two three hundred and ", ""),
    "under_hundreds": ("under ", "hundred ", "words"),
    "digits": ("", "1234567890", ""),
    "digits_commas": ("", "1,234,567,", ""),
    "cn_numerals": ("", "不超过一二三十百千万亿字", ""),
    "repeated_units": ("", "words ", ""),
    "ages": ("", "eighty-five years old 八十五岁 ", ""),
    "mixed_scripts": ("", "不超过 fifty 五十 words 字 ５０ Слово 単語 ", ""),
    "role_lines": ("", "User: in under fifty words\n", ""),
    "sys_unclosed": ("<<SYS>>", "System: 不超过50字 under 50 words ", ""),
}
# The control (--prompts plain): ordinary prose of the same size, to tell the cost of hostile text from the cost of
# any prompt at the cap.
PLAIN_KINDS: dict[str, tuple[str, str, str]] = {
    "plain_en": ("", "The farmer explains how the crops grow in spring and why the river floods every year. ", ""),
    "plain_zh": ("", "今天天气很好，我们去公园散步，看到很多人在湖边锻炼身体。", ""),
}


def _loopback(address: str) -> str:
    # The bench floods what it targets: a cluster on this machine, never one reached over a network.
    if address.rpartition(":")[0] not in LOOPBACK:
        raise argparse.ArgumentTypeError(f"the front-door bench only talks to 127.0.0.1; got {address!r}")
    return address


def _levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 4,8; got {text!r}")
    return levels


def build_prompts(model: str, max_tokens: int = ADVERSARIAL_MAX_TOKENS,
                  kinds: dict[str, tuple[str, str, str]] = KINDS) -> dict[str, str]:
    """Every kind at the cap: as many bytes as admission accepts with `max_tokens`, checked with the tokenizer."""
    tokenizer = load_model_tokenizer(resolve_model(model))
    # Byte-level tokenizer: one token per byte, so the token cap (less the output) is also the byte budget.
    token_budget = settings.MAX_PROMPT_TOKENS - max_tokens
    byte_budget = min(settings.MAX_PROMPT_BYTES, token_budget)
    prompts = {}
    for name, (head, unit, tail) in kinds.items():
        room = byte_budget - len(head.encode()) - len(tail.encode())
        body = unit * (room // len(unit.encode()))
        if not tail:   # top up with the unit's first characters: as close to the cap as whole characters go
            for ch in unit:
                if len((body + ch).encode()) > room:
                    break
                body += ch
        text = head + body + tail
        while len(tokenizer.encode(text)) > token_budget:   # a tokenizer that is not byte-level: trim to fit
            text = text[:-(len(tail) + 1)] + tail
        prompts[name] = text
    return prompts


# ---- adversarial load: in its own process, so its client work does not sit on the probe's event loop --------

def _warm() -> int:
    """A no-op job: starts the load process before the first phase, so its start-up is never measured."""
    return os.getpid()


def run_load(target: str, prompts: list[str], clients: int, seconds: float, via: str, timeout: float) -> dict:
    """K clients in a closed loop over `prompts` for `seconds`; counts of served requests and errors."""
    return asyncio.run(_load(target, prompts, clients, seconds, via, timeout))


async def _load(target: str, prompts: list[str], clients: int, seconds: float, via: str, timeout: float) -> dict:
    served = 0
    errors: collections.Counter[str] = collections.Counter()
    t0 = time.monotonic()
    stop_at = t0 + seconds

    async def one(i: int) -> None:
        nonlocal served
        async with AsyncClient(target, timeout=timeout, retry=None) as client:
            n = i   # clients start at different kinds so every kind is in flight at once
            while time.monotonic() < stop_at:
                prompt = prompts[n % len(prompts)]
                n += 1
                try:
                    if via == "tag":
                        await client.tag(prompt, max_tokens=ADVERSARIAL_MAX_TOKENS)
                    else:
                        await client.generate(prompt, max_tokens=ADVERSARIAL_MAX_TOKENS)
                    served += 1
                except TetherError as e:
                    errors[e.code.name] += 1
                    await asyncio.sleep(0.05)   # a refusal must not turn the loop into a spin

    await asyncio.gather(*(one(i) for i in range(clients)))
    wall = time.monotonic() - t0
    return dict(served=served, errors=dict(errors), wall_s=round(wall, 3), per_s=round(served / wall, 2))


# ---- the probe ---------------------------------------------------------------------------------------------

async def probe(client: AsyncClient, seconds: float,
                interval: float) -> tuple[list[float], list[float], dict[str, int]]:
    """The small request, one at a time every `interval` seconds for `seconds`, each followed by a Tag of the same
    prompt (admission's share of it alone): Generate latencies (ms), Tag latencies (ms) and errors."""
    latencies: list[float] = []
    tag_latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    stop_at = time.monotonic() + seconds
    while time.monotonic() < stop_at:
        t0 = time.perf_counter()
        try:
            # ignore_eos: always 4 tokens, so every sample does the same work.
            await client.generate(PROBE_PROMPT, max_tokens=PROBE_MAX_TOKENS, temperature=0.0, ignore_eos=True)
            t1 = time.perf_counter()
            latencies.append((t1 - t0) * 1e3)
            await client.tag(PROBE_PROMPT, max_tokens=PROBE_MAX_TOKENS)
            tag_latencies.append((time.perf_counter() - t1) * 1e3)
        except TetherError as e:
            errors[e.code.name] += 1
        await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t0)))
    return latencies, tag_latencies, dict(errors)


def _stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return dict(count=0, p50=None, p90=None)
    return dict(count=len(values), p50=round(percentile(values, 50), 2), p90=round(percentile(values, 90), 2))


async def kind_costs(client: AsyncClient, prompts: dict[str, str], repeats: int, via: str) -> dict[str, float]:
    """Idle latency (median ms) of one adversarial prompt of each kind: also proves admission accepts them all."""
    out = {}
    for name, prompt in prompts.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if via == "tag":
                await client.tag(prompt, max_tokens=ADVERSARIAL_MAX_TOKENS)
            else:
                await client.generate(prompt, max_tokens=ADVERSARIAL_MAX_TOKENS)
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = round(percentile(times, 50), 2)
    return out


async def bench(args: argparse.Namespace, target: str) -> dict:
    """Every phase against `target`; returns the report."""
    prompts = build_prompts(args.model, kinds=PLAIN_KINDS if args.prompts == "plain" else KINDS)
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    phases: list[dict] = []
    try:
        await loop.run_in_executor(pool, _warm)   # start the load process now, not inside a measured phase
        async with AsyncClient(target, timeout=args.timeout, retry=None) as client:
            costs = await kind_costs(client, prompts, args.kind_repeats, args.via)
            await probe(client, min(2.0, args.phase_seconds), args.probe_interval)   # warm-up, not counted
            order = [k for _ in range(args.rounds) for level in args.levels for k in (0, level)]
            for i, k in enumerate(order):
                load = None
                if k:
                    # Runs past the probe window by the settle time at both ends, so every sample sees the load.
                    load = loop.run_in_executor(pool, run_load, target, list(prompts.values()), k,
                                                args.phase_seconds + 2 * args.settle, args.via, args.timeout)
                    await asyncio.sleep(args.settle)
                latencies, tag_latencies, errors = await probe(client, args.phase_seconds, args.probe_interval)
                phase = dict(index=i, clients=k, probe=_stats(latencies), probe_tag=_stats(tag_latencies),
                             probe_errors=errors, latencies_ms=[round(x, 2) for x in latencies],
                             tag_latencies_ms=[round(x, 2) for x in tag_latencies])
                if load is not None:
                    phase["adversarial"] = await load
                phases.append(phase)
                if not args.quiet:
                    adv = f", adversarial {phase['adversarial']['per_s']}/s" if load is not None else ""
                    print(f"front-door phase {i + 1}/{len(order)} K={k}: p50 {phase['probe']['p50']} ms "
                          f"over {len(latencies)} probes{adv}", file=sys.stderr, flush=True)
    finally:
        pool.shutdown(cancel_futures=True)
    return dict(prompts={n: dict(bytes=len(p.encode()), chars=len(p), idle_ms=costs[n]) for n, p in prompts.items()},
                phases=phases, summary=summarize(phases, args.levels))


def summarize(phases: list[dict], levels: list[int]) -> dict:
    """Pooled probe latencies per K (0 = idle), the ratio of medians loaded / idle, the adversarial rate."""
    pooled: dict[int, list[float]] = collections.defaultdict(list)
    pooled_tag: dict[int, list[float]] = collections.defaultdict(list)
    for p in phases:
        pooled[p["clients"]] += p["latencies_ms"]
        pooled_tag[p["clients"]] += p["tag_latencies_ms"]
    idle = _stats(pooled[0])
    rows = {"idle": dict(clients=0, **idle, ratio=1.0 if idle["p50"] else None, tag=_stats(pooled_tag[0]),
                         adversarial_per_s=None, adversarial_errors={})}
    for k in levels:
        loaded = [p for p in phases if p["clients"] == k]
        s = _stats(pooled[k])
        errors: collections.Counter[str] = collections.Counter()
        for p in loaded:
            errors.update(p["adversarial"]["errors"])
        served = sum(p["adversarial"]["served"] for p in loaded)
        wall = sum(p["adversarial"]["wall_s"] for p in loaded)
        ratio = round(s["p50"] / idle["p50"], 3) if s["p50"] and idle["p50"] else None
        # Side by side: each loaded phase against the idle phase just before it.
        pairs = [round(p["probe"]["p50"] / phases[p["index"] - 1]["probe"]["p50"], 3) for p in loaded
                 if p["probe"]["p50"] and phases[p["index"] - 1]["probe"]["p50"]]
        rows[f"K={k}"] = dict(clients=k, **s, ratio=ratio, pair_ratios=pairs, tag=_stats(pooled_tag[k]),
                              adversarial_per_s=round(served / wall, 1) if wall else None,
                              adversarial_errors=dict(errors))
    probe_errors: collections.Counter[str] = collections.Counter()
    for p in phases:
        probe_errors.update(p["probe_errors"])
    ratios = [r["ratio"] for r in rows.values() if r["clients"] and r["ratio"] is not None]
    return dict(rows=rows, max_ratio=max(ratios) if ratios else None, probe_errors=dict(probe_errors))


def table(report: dict) -> str:
    lines = [f"{'phase':<8} {'probes':>6} {'p50 ms':>8} {'p90 ms':>8} {'ratio':>6} {'per-round':>14} "
             f"{'tag p50 ms':>10} {'adversarial/s':>13}  adversarial errors"]
    for name, r in report["summary"]["rows"].items():
        pairs = ",".join(f"{x:.2f}" for x in r.get("pair_ratios", [])) or "-"
        rate = "-" if r["adversarial_per_s"] is None else f"{r['adversarial_per_s']:.1f}"
        errs = ", ".join(f"{c} {n}" for c, n in r["adversarial_errors"].items()) or "-"
        fmt = lambda x: "-" if x is None else f"{x:.1f}"   # noqa: E731
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"{name:<8} {r['count']:>6} {fmt(r['p50']):>8} {fmt(r['p90']):>8} {ratio:>6} {pairs:>14} "
                     f"{fmt(r['tag']['p50']):>10} {rate:>13}  {errs}")
    costs = ", ".join(f"{n} {p['idle_ms']:.0f}" for n, p in report["prompts"].items())
    meta = report["meta"]
    lines.append(f"one load prompt alone ({meta['prompts']}, via {meta['via']}), median ms: {costs}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.front_door", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Latency of a small request while K clients send adversarial prompts "
                                            "at the prompt cap, against its idle latency.", epilog=__doc__)
    g = p.add_argument_group("cluster")
    g.add_argument("--target", type=_loopback, metavar="HOST:PORT",
                   help="attach to a running cluster's admission instead of starting one")
    g.add_argument("--model", default="tiny",
                   help="served model; its tokenizer sizes the prompts (default: %(default)s)")
    g.add_argument("--stages", type=int, default=2, help="stages to start (default: %(default)s)")
    g.add_argument("--threads", type=int, default=1, help="torch threads per stage (default: %(default)s)")
    g.add_argument("--log-dir", type=Path, default=Path("bench-out/front-door/logs"),
                   help="service logs of the cluster it starts (default: %(default)s)")
    g = p.add_argument_group("load")
    g.add_argument("--levels", type=_levels, default=[4, 8], metavar="K,K",
                   help="concurrent adversarial clients of the loaded phases (default: 4,8)")
    g.add_argument("--rounds", type=int, default=2,
                   help="times the sequence idle, K1, idle, K2 ... is run (default: %(default)s)")
    g.add_argument("--phase-seconds", type=float, default=10.0,
                   help="probe window of each phase (default: %(default)s)")
    g.add_argument("--settle", type=float, default=1.0,
                   help="seconds the load runs before (and after) a loaded phase's probe window (default: %(default)s)")
    g.add_argument("--probe-interval", type=float, default=0.25,
                   help="seconds between the starts of two probe requests (default: %(default)s)")
    g.add_argument("--via", choices=["tag", "generate"], default="tag",
                   help="adversarial requests as Tag (admission's work only) or Generate with max_tokens=1 (adds "
                        "a 4K-token prefill in the pipeline) (default: %(default)s)")
    g.add_argument("--prompts", choices=["adversarial", "plain"], default="adversarial",
                   help="the loaded phases' prompts: the adversarial kinds, or plain prose of the same size as a "
                        "control (default: %(default)s)")
    g.add_argument("--kind-repeats", type=int, default=3,
                   help="idle sends of each adversarial kind before the phases (default: %(default)s)")
    g.add_argument("--timeout", type=float, default=30.0,
                   help="every call's deadline in seconds (default: %(default)s)")
    g = p.add_argument_group("checks and output")
    g.add_argument("--max-ratio", type=float, default=2.0,
                   help="exit 1 when a level's median probe latency exceeds this times the idle median "
                        "(default: %(default)s)")
    g.add_argument("--out", type=Path, help="write the JSON report here")
    g.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cluster = None
    if args.target is None:
        cluster = LocalCluster(model=args.model, stages=args.stages, threads=args.threads, log_dir=args.log_dir)
        print(f"front-door: starting {args.model} with {args.stages} stages (logs in {args.log_dir}) ...",
              file=sys.stderr)
        cluster.start(timeout=START_TIMEOUT_S)
    target = args.target or cluster.target
    try:
        report = asyncio.run(bench(args, target))
    finally:
        if cluster is not None:
            cluster.stop()
    report["meta"] = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                          command=shlex.join(["python", "-m", "bench.front_door", *(argv or sys.argv[1:])]),
                          target=target, spawned=cluster is not None, model=args.model, via=args.via,
                          prompts=args.prompts,
                          levels=args.levels, rounds=args.rounds, phase_seconds=args.phase_seconds,
                          probe=dict(prompt=PROBE_PROMPT, max_tokens=PROBE_MAX_TOKENS, interval_s=args.probe_interval),
                          max_ratio=args.max_ratio, cpus=os.cpu_count(), load_average_end=os.getloadavg())
    s = report["summary"]
    failed = bool(s["probe_errors"]) or s["max_ratio"] is None or s["max_ratio"] > args.max_ratio
    report["passed"] = not failed
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(table(report))
    verdict = "PASS" if not failed else "FAIL"
    print(f"{verdict}: worst median ratio loaded/idle {s['max_ratio']} (limit {args.max_ratio:g}); "
          f"probe errors {s['probe_errors'] or 'none'}" + (f"; report {args.out}" if args.out else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
