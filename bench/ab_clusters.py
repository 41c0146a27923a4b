"""Two tether clusters that differ in flags or environment, measured one at a time: both kept up, each run's load
sent to one while the other idles, the order alternating pair by pair, each pair the same requests; output tok/s,
B ÷ A per pair and the medians, with each run's served step (the stages' Stats: busy, sampling, outside).

Loading both at once misleads on a 2-core machine (a stage idling in one cluster leaves its core to the other, so
a mode that idles looks better than it is alone: docs/PERFORMANCE.md "Served throughput"). Here the idle cluster
costs nothing but memory.

    .venv/bin/python bench/ab_clusters.py --flags "b:coordinator:--alone-max-requests 0" --isa avx2
    .venv/bin/python bench/ab_clusters.py --env "b:TETHER_KERNELS_ISA=avx2" --workload synthetic --pairs 4

--flags SIDE:ROLE:FLAGS adds FLAGS (split as a shell would) to every ROLE (stage, coordinator or admission) of
side a or b; --env SIDE:NAME=VALUE sets a variable in that side's processes only (a kernel or a setting read at
start). The load is the llama-server comparison's (bench/llama_server_vs_tether.py): closed loop over the
OpenAI-compatible HTTP face, chat (`single` prompts, EOS honoured) or synthetic (--input-len / --output-len).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llama_server_vs_tether import run_level, summary  # noqa: E402
from tether import settings  # noqa: E402
from tether.loadtest import cluster_stats  # noqa: E402
from tether.loadtest.workloads import SyntheticSpec, Workload  # noqa: E402

SIDES = ("a", "b")
ROLES = ("stage", "coordinator", "admission")
MIXES = {"chat": {"single": 1.0}, "synthetic": {"synthetic": 1.0}}


def parse_flags(items: list[str]) -> dict[str, dict[str, list[str]]]:
    """--flags SIDE:ROLE:FLAGS items as each side's LocalCluster `extra` (ROLE -> flags, in the order given)."""
    out: dict[str, dict[str, list[str]]] = {side: {} for side in SIDES}
    for item in items:
        side, role, flags = (item.split(":", 2) + ["", ""])[:3]
        if side not in SIDES or role not in ROLES or not flags.strip():
            raise ValueError(f"--flags {item!r}: say SIDE:ROLE:FLAGS, SIDE a or b, ROLE one of {', '.join(ROLES)}")
        out[side].setdefault(role, []).extend(shlex.split(flags))
    return out


def parse_env(items: list[str]) -> dict[str, dict[str, str]]:
    """--env SIDE:NAME=VALUE items as each side's variables."""
    out: dict[str, dict[str, str]] = {side: {} for side in SIDES}
    for item in items:
        side, _, assignment = item.partition(":")
        name, eq, value = assignment.partition("=")
        if side not in SIDES or not eq or not name or not name.isidentifier():
            raise ValueError(f"--env {item!r}: say SIDE:NAME=VALUE, SIDE a or b")
        out[side][name] = value
    return out


def pairs_summary(a: list[float], b: list[float]) -> dict:
    """Each pair's B ÷ A and the medians of A, B and the ratios (a pair whose A read nothing has no ratio)."""
    ratios = [y / x for x, y in zip(a, b) if x > 0]
    return dict(a=statistics.median(a) if a else None, b=statistics.median(b) if b else None, ratios=ratios,
                ratio=statistics.median(ratios) if ratios else None)


def start(side: str, args: argparse.Namespace, extra: dict[str, list[str]], env: dict[str, str], logs: Path):
    """Side `side`'s cluster, its variables set only while its processes start (they inherit them)."""
    from tether.cli.cluster import LocalCluster
    from tether.loadtest.cli import stage_threads
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        cluster = LocalCluster(model=args.model, stages=args.stages, threads=stage_threads(args),
                               log_dir=logs / side, extra=extra)
        print(f"starting {side}: extra {extra or '-'}, env {env or '-'} (logs {logs / side}) ...", file=sys.stderr,
              flush=True)
        return cluster.start(timeout=600)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flags", action="append", default=[], metavar="SIDE:ROLE:FLAGS",
                   help="flags for every ROLE (stage, coordinator, admission) of side a or b; repeatable")
    p.add_argument("--env", action="append", default=[], metavar="SIDE:NAME=VALUE",
                   help="a variable in side a's or b's processes; repeatable")
    p.add_argument("--isa", choices=settings.KERNELS_ISAS, default=None,
                   help=f"both sides' {settings.KERNELS_ISA_ENV} (default: as this shell has it)")
    p.add_argument("--model", default="smollm2", help="the model both serve (default: %(default)s)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="threads per stage (default: as `tether up`)")
    p.add_argument("--workload", choices=sorted(MIXES), default="chat")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=64, help="requests per run (default: %(default)s)")
    p.add_argument("--pairs", type=int, default=3, help="runs per side, alternating which goes first")
    p.add_argument("--out", type=Path, default=None, help="write the runs and the summary as JSON here")
    args = p.parse_args()
    # `kill PID` unwinds like Ctrl-C (a background job ignores SIGINT): both clusters are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        extra, env = parse_flags(args.flags), parse_env(args.env)
    except ValueError as e:
        p.error(str(e))
    if args.isa:
        os.environ[settings.KERNELS_ISA_ENV] = args.isa

    from tether.model.folder import load_model_tokenizer
    from tether.model.loader import resolve_model
    workload = Workload(MIXES[args.workload], load_model_tokenizer(resolve_model(args.model)).encode,
                        SyntheticSpec(args.input_len, args.output_len, 0.0))
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="ab-clusters-") as tmp:
        clusters = {}
        try:
            for side in SIDES:
                clusters[side] = start(side, args, extra[side], env[side], Path(tmp))
            probes = {side: cluster_stats.EngineProbe(c.service("coordinator").address,
                                                      [c.service(f"stage{i}").address for i in range(args.stages)])
                      for side, c in clusters.items()}
            urls = {side: c.base_url or "" for side, c in clusters.items()}   # LocalCluster serves HTTP by default
            for url in urls.values():   # warm-up, not counted
                asyncio.run(run_level(url, "tether", workload.take(args.concurrency, "warmup"), args.concurrency))
            for i in range(args.pairs):
                requests = workload.take(args.requests, f"pair{i}")
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                    probes[side].before()
                    s = summary(asyncio.run(run_level(urls[side], "tether", requests, args.concurrency)))
                    s["step"] = (probes[side].after()["engine"] or {}).get("step")
                    runs[side].append(s)
                    print(f"pair {i + 1} {side}: {s['tok_s']:.1f} tok/s ({s['completed']}/{args.requests} done, "
                          f"TPOT p50 {s['tpot_p50_ms'] or 0:.0f} ms); {cluster_stats.served_step_text(s['step'])}"
                          + (f" ERRORS {s['errors']}" if s["failed"] else ""), flush=True)
        finally:
            for c in clusters.values():
                c.stop()
    result = pairs_summary([r["tok_s"] for r in runs["a"]], [r["tok_s"] for r in runs["b"]])
    print(f"median tok/s: a {result['a']:.1f}, b {result['b']:.1f}; b / a {result['ratio']:.3f} (pairs "
          + ", ".join(f"{r:.3f}" for r in result["ratios"]) + ")")
    if args.out:
        args.out.write_text(json.dumps(dict(args=vars(args) | {"out": str(args.out)}, runs=runs, summary=result),
                                       indent=1, default=str))


if __name__ == "__main__":
    main()
