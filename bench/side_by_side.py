"""What the overhead benchmarks (metrics, tracing, security) share: the same `tether bench` level sent to two
clusters side by side, its checks, and the flags that size it."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_level_flags(p: argparse.ArgumentParser, repeats_help: str) -> None:
    """The flags of the clusters compared and of the level each repeat sends to both."""
    p.add_argument("--model", default="tiny", help="the model both clusters serve (default: %(default)s)")
    p.add_argument("--stages", type=int, default=2, help="stages per cluster (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help=f"{repeats_help} (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop users (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default: %(default)s)")


def bench(target: str, args: argparse.Namespace, out: Path, extra: Sequence[str] = ()) -> dict:
    """One `tether bench` level against `target` (`extra`: more flags, e.g. credentials or --audit): its
    summary, after checking that every request completed and, when audited, that none mismatched."""
    cmd = [sys.executable, "-m", "tether.cli.main", "bench", "--target", target, "--model", args.model,
           "--stages", str(args.stages), "--threads", str(args.threads), "--concurrency", str(args.concurrency),
           "--num-requests", str(args.num_requests), "--warmup", "4", "--workload", "synthetic",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", "0",
           "--out", str(out), "--quiet", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    (level,) = json.loads((out / "report.json").read_text())["levels"]
    s = level["summary"]
    assert s["completed"] == s["requests"], f"{s['requests'] - s['completed']} request(s) failed"
    assert not (level.get("audit") or {}).get("mismatch"), f"audit mismatches: {level['audit']}"
    return s


def together(runs: dict[str, Callable[[], dict]]) -> dict[str, dict]:
    """Run each side's level at the same time (one thread each), so that whatever else loads a shared machine
    loads every side alike; their summaries by side. A side that fails raises after all have ended."""
    result: dict[str, dict] = {}
    threads = [threading.Thread(target=lambda side=side, run=run: result.__setitem__(side, run()))
               for side, run in runs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(result) == set(runs), "a bench run failed (its error is above)"
    return result


def summarize(what: str, pairs: list[dict], args: argparse.Namespace, **extra) -> dict:
    """The figure of a side-by-side run: the median (min, max) of the pairs' `ratio`, printed as one line
    beginning with `what`; the JSON summary with the pairs, `extra` and the arguments."""
    ratios = [x["ratio"] for x in pairs]
    summary = dict(median_ratio=statistics.median(ratios), min_ratio=min(ratios), max_ratio=max(ratios), **extra,
                   pairs=pairs, args={k: str(v) for k, v in vars(args).items()})
    print(f"{what}, output tokens/s: median {summary['median_ratio']:.3f} (min {summary['min_ratio']:.3f}, "
          f"max {summary['max_ratio']:.3f}) over {len(ratios)} pairs", flush=True)
    return summary
