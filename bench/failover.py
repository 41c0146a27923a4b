"""Failover under steady load: two pipelines, one coordinator SIGKILLed every --kill-every seconds (and started
again at once, as `tether up` would), streams sent all along with the SDK's retries off, so only admission's
resume (docs/PROTOCOL.md "Resume") stands between a kill and a client error.

    .venv/bin/python -m bench.failover                       # 60 s, a kill every 15 s, 8 streams at a time
    .venv/bin/python -m bench.failover --duration 30 --kill-every 10 --concurrency 4

Prints requests completed, client errors, mismatches against tether.reference, requests admission resumed,
and the stall at the seam (the largest gap between two tokens of a stream: p50, p99, max). Exits 1 on any
error or mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tether import reference
from tether.cli.cluster import LocalCluster
from tether.client import AsyncClient, TetherError

PROMPTS = ["从前有一座山，山上有", "The quick brown fox", "请用一句话介绍长城", "Once upon a time there"]


def case(i: int, max_tokens: int) -> tuple[str, dict]:
    sampling: dict = dict(max_tokens=max_tokens, ignore_eos=True)
    if i % 2:
        sampling.update(temperature=0.8, top_p=0.95, seed=1000 + i)
    if i % 4 == 3:
        sampling["stop"] = ["的", " the"]
    return PROMPTS[i % len(PROMPTS)], sampling


def resumed_total(cluster: LocalCluster) -> float:
    text = urllib.request.urlopen(cluster.service("admission").metrics_url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tether:requests_resumed_total{"))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def load(target: str, args: argparse.Namespace, until: float, out: dict) -> None:
    """`--concurrency` workers, each sending one stream after another until `until`."""
    async def worker(w: int, client: AsyncClient) -> None:
        n = 0
        while time.monotonic() < until:
            i = w * 1000 + n
            n += 1
            prompt, sampling = case(i, args.max_tokens)
            ids, last, gap = [], None, 0.0
            try:
                stream = client.stream(prompt, **sampling)
                async for delta in stream:
                    now = time.perf_counter()
                    if last is not None:
                        gap = max(gap, now - last)
                    last = now
                    ids.append(delta.token_id)
            except TetherError as e:
                out["errors"].append(f"{e.code.name}: {e.message}")
                continue
            out["done"].append((prompt, sampling, ids, gap))

    async with AsyncClient(target, timeout=args.request_timeout, retry=None) as client:
        await asyncio.gather(*(worker(w, client) for w in range(args.concurrency)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default: %(default)s)")
    p.add_argument("--kill-every", type=float, default=15.0, help="seconds between kills (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="streams at a time (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=40, help="per stream (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tether-failover-") as logs:
        cluster = LocalCluster(model="tiny", stages=1, pipelines=2, threads=1, metrics=True, log_dir=Path(logs))
        cluster.start(timeout=180)
        try:
            out: dict = {"done": [], "errors": []}
            t0 = time.monotonic()
            until = t0 + args.duration
            loop = asyncio.new_event_loop()
            task = loop.create_task(load(cluster.target, args, until, out))
            kills, victims, next_kill = 0, ["coordinator", "p1-coordinator"], t0 + args.kill_every
            while not task.done():   # kills from this (the spawning) thread: children die with their spawner
                loop.run_until_complete(asyncio.wait([task], timeout=0.2))
                if time.monotonic() >= next_kill and time.monotonic() < until:
                    name = victims[kills % 2]
                    cluster.kill(name)
                    cluster.restart(name)
                    kills += 1
                    next_kill += args.kill_every
            task.result()
            loop.close()
            resumed = resumed_total(cluster)
        finally:
            cluster.stop()
    mismatches = 0
    for prompt, sampling, ids, _ in out["done"]:
        if ids != reference.generate(prompt, **sampling).token_ids:
            mismatches += 1
    gaps = [g for *_, g in out["done"]]
    figures = dict(duration_s=args.duration, kills=kills, completed=len(out["done"]), errors=len(out["errors"]),
                   mismatches=mismatches, resumed=resumed, stall_p50_s=round(percentile(gaps, 0.5), 3),
                   stall_p99_s=round(percentile(gaps, 0.99), 3), stall_max_s=round(max(gaps, default=0.0), 3))
    print(json.dumps(figures))
    for e in out["errors"][:5]:
        print("error:", e, file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if out["errors"] or mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
