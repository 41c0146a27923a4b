"""Two running clusters, e.g. a checkout of main and this branch (`tether up` on other ports), the same
`tether bench` levels sent to each in turn: the output tokens/s of each side at each concurrency, and their
ratio, as medians of repeats. Sides alternate which goes first every repeat, so that a shared machine's
load falls on both alike. Each side is measured by its own checkout's `tether bench` (--a-root, --b-root):
a client checks the receipts' fingerprint the way its own services name it.

    .venv/bin/python bench/speedup.py --a 127.0.0.1:52051 --a-root /tmp/base --b 127.0.0.1:53051 \
        --model smollm2 --repeats 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.side_by_side import add_level_flags  # noqa: E402


def bench(target: str, root: Path, args: argparse.Namespace, out: Path) -> dict:
    """One synthetic `tether bench` level against `target`, run from checkout `root`: its summary, after
    checking that every request completed."""
    cmd = [sys.executable, "-m", "tether.cli.main", "bench", "--target", target, "--model", args.model,
           "--stages", str(args.stages), "--threads", str(args.threads), "--concurrency", str(args.concurrency),
           "--num-requests", str(args.num_requests), "--warmup", str(args.warmup), "--workload", "synthetic",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", "0",
           "--out", str(out), "--quiet"]
    subprocess.run(cmd, check=True, cwd=root, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(root)})
    (level,) = json.loads((out / "report.json").read_text())["levels"]
    s = level["summary"]
    assert s["completed"] == s["requests"], f"{s['requests'] - s['completed']} request(s) failed"
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="admission of the baseline cluster")
    p.add_argument("--b", required=True, help="admission of the cluster measured against it")
    p.add_argument("--a-root", type=Path, default=ROOT, help="checkout whose client measures --a (default: this one)")
    p.add_argument("--b-root", type=Path, default=ROOT, help="checkout whose client measures --b (default: this one)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests per level (default: %(default)s)")
    p.add_argument("--levels", default="1,8", help="concurrencies, each a level (default: %(default)s)")
    p.add_argument("--requests-per-user", type=int, default=1,
                   help="requests per level = this x its concurrency, at least --min-requests (default: %(default)s)")
    p.add_argument("--min-requests", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON summary here")
    add_level_flags(p, "repeats per side and level")
    args = p.parse_args()
    figures: dict[int, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for conc in (int(c) for c in args.levels.split(",")):
                level = copy.copy(args)
                level.concurrency, level.num_requests = conc, max(args.min_requests, args.requests_per_user * conc)
                order = ("a", "b") if rep % 2 == 0 else ("b", "a")
                for side in order:
                    s = bench(getattr(args, side), getattr(args, f"{side}_root"), level, Path(tmp) / f"{side}-{conc}-{rep}")
                    figures.setdefault(conc, {}).setdefault(side, []).append(s["output_token_throughput"])
                    print(f"repeat {rep} concurrency {conc} {side}: {s['output_token_throughput']:.1f} tok/s", flush=True)
    summary = {}
    for conc, sides in figures.items():
        a, b = statistics.median(sides["a"]), statistics.median(sides["b"])
        summary[conc] = dict(a_median=a, b_median=b, ratio=b / a, a=sides["a"], b=sides["b"])
        print(f"concurrency {conc}: a {a:.1f} tok/s, b {b:.1f} tok/s (medians of {len(sides['a'])}): "
              f"b/a {b / a:.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(levels=summary, args={k: str(v) for k, v in vars(args).items()}), indent=2))


if __name__ == "__main__":
    main()
