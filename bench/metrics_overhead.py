"""What Prometheus metrics cost: `tether bench` throughput with every service's /metrics on, divided by off.

Two local clusters run side by side for the whole run, identical but for `--metrics-port` (LocalCluster
metrics=True). Each repeat sends the same `tether bench` level to both: by default at the same time
(--together), so that whatever else loads a shared machine at that moment loads both sides alike; with
--alternate one after the other, alternating which goes first, while the other idles. The figure is the median
over repeats of on ÷ off output-token throughput. While the metrics cluster is loaded,
a scraper reads all of its services' /metrics every --scrape-interval seconds (Prometheus in
docker-compose.yml scrapes every 5 s; 1 s here is the pessimistic case), so the collectors' cost is in.

    .venv/bin/python bench/metrics_overhead.py                      # tiny, 2 stages, 5 repeats
    .venv/bin/python bench/metrics_overhead.py --repeats 7 --num-requests 96

Figures: docs/PERFORMANCE.md, "Metrics overhead".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # spinning OpenMP threads starve the other processes

from tether.cli.cluster import LocalCluster  # noqa: E402 - after the environment is set

ROOT = Path(__file__).resolve().parents[1]


class Scraper(threading.Thread):
    """GET every URL every `interval` seconds until stopped; counts scrapes and failures."""

    def __init__(self, urls: list[str], interval: float) -> None:
        super().__init__(daemon=True)
        self.urls, self.interval = urls, interval
        self.stop = threading.Event()
        self.scrapes = self.failures = 0

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        r.read()
                    self.scrapes += 1
                except OSError:
                    self.failures += 1


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="the model both clusters serve (default: %(default)s)")
    p.add_argument("--stages", type=int, default=2, help="stages per cluster (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="off/on pairs, alternating order (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop users (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (default: %(default)s)")
    p.add_argument("--scrape-interval", type=float, default=1.0,
                   help="seconds between scrapes of every service of the metrics cluster (default: %(default)s)")
    p.add_argument("--alternate", action="store_true",
                   help="load one cluster at a time (alternating which first) instead of both at once")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    logs = Path(tempfile.mkdtemp(prefix="tether-metrics-overhead-"))
    off = LocalCluster(model=args.model, stages=args.stages, threads=args.threads, log_dir=logs / "off")
    on = LocalCluster(model=args.model, stages=args.stages, threads=args.threads, log_dir=logs / "on", metrics=True)
    pairs = []
    try:
        off.start(timeout=300)
        on.start(timeout=300)
        for r in range(args.repeats):
            result = {}
            scraper = Scraper([s.metrics_url for s in on.services], args.scrape_interval)
            scraper.start()
            try:
                if args.alternate:
                    for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
                        cluster = on if side == "on" else off
                        result[side] = bench(cluster.target, args, logs / f"bench-{r}-{side}")
                else:
                    result = together({side: lambda side=side, c=c: bench(c.target, args, logs / f"bench-{r}-{side}")
                                       for side, c in (("off", off), ("on", on))})
            finally:
                scraper.stop.set()
                scraper.join()
            assert scraper.scrapes and not scraper.failures, (scraper.scrapes, scraper.failures)
            result["scrapes"] = scraper.scrapes
            ratio = result["on"]["output_token_throughput"] / result["off"]["output_token_throughput"]
            pairs.append(dict(off=result["off"]["output_token_throughput"], on=result["on"]["output_token_throughput"],
                              ratio=ratio, scrapes=result["scrapes"]))
            print(f"repeat {r + 1}/{args.repeats}: off {pairs[-1]['off']:.1f} tok/s, on {pairs[-1]['on']:.1f} "
                  f"tok/s, on/off {ratio:.3f} ({result['scrapes']} scrapes)", flush=True)
    finally:
        on.stop()
        off.stop()
    ratios = [x["ratio"] for x in pairs]
    summary = dict(median_ratio=statistics.median(ratios), min_ratio=min(ratios), max_ratio=max(ratios),
                   pairs=pairs, args={k: str(v) for k, v in vars(args).items()})
    print(f"metrics on / off, output tokens/s: median {summary['median_ratio']:.3f} "
          f"(min {summary['min_ratio']:.3f}, max {summary['max_ratio']:.3f}) over {len(ratios)} pairs", flush=True)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
