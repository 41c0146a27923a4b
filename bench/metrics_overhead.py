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

Figures: docs/PERFORMANCE.md, "Overheads".
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # spinning OpenMP threads starve the other processes

from side_by_side import add_level_flags, bench, summarize, together  # noqa: E402
from tether.cli.cluster import LocalCluster  # noqa: E402 - after the environment is set

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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_level_flags(p, "off/on pairs, alternating order")
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
                    result = together({side: lambda side=side, c=c, r=r: bench(c.target, args,
                                                                               logs / f"bench-{r}-{side}")
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
    summary = summarize("metrics on / off", pairs, args)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
