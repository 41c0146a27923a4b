"""Overload control end to end (issue 12): two pipelines behind one admission, at twice the saturating rate.

1. Saturation: a closed loop of --concurrency users measures the rate the cluster serves (req/s).
2. Overload: open loop (Poisson) at --overload x that rate for --duration s. Requests are 20% critical, 50%
   standard, 30% sheddable; half come from tenant `bulk`, whose token bucket (--bulk-tokens-per-s) is far
   below its share, half from `app`, unlimited. The SDK's retries are off: every answer is admission's own.
   Reported per priority and tenant: served, refused (code, RetryInfo present, how fast the refusal came),
   TTFT p50/p99 of the served, and hung (no answer within the deadline + grace: must be 0).
3. A pipeline killed under load: tenant app's mix at 0.75x the saturating rate with the SDK's retries on; pipeline 1's
   coordinator is SIGKILLed while it runs requests. Reported: requests that failed explicitly and succeeded on
   the SDK's first retry, requests that failed after every retry, and wrong answers (every served answer is
   audited against the in-process reference: must be 0).

    .venv/bin/python -m bench.overload --out bench-out/overload/report.json     # ~6 minutes on tiny (make bench-overload)

Figures: docs/PERFORMANCE.md, "Overload control".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # spinning OpenMP threads starve the other processes

import grpc  # noqa: E402

from tether import reference  # noqa: E402
from tether.cli.cluster import LocalCluster  # noqa: E402
from tether.client import AsyncClient  # noqa: E402
from tether.client.errors import TetherError  # noqa: E402
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

PROMPTS = ["Explain in under 30 words why the sky is blue.", "写一首关于秋天的短诗", "def fib(n):",
           "Summarize: the quick brown fox jumps over the lazy dog.", "你好", "List three uses of copper."]
PRIORITIES = [("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3)]
TENANTS = ("app", "bulk")
GRACE_S = 30.0


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    f = int(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def request(i: int, rng: random.Random, tenants: tuple[str, ...] = TENANTS) -> dict:
    priority = rng.choices([p for p, _ in PRIORITIES], [w for _, w in PRIORITIES])[0]
    return dict(prompt=f"{PROMPTS[i % len(PROMPTS)]} #{i}", max_tokens=12, priority=priority,
                tenant=tenants[i % len(tenants)])


async def one(client: AsyncClient, req: dict, deadline_s: float) -> dict:
    t0 = time.perf_counter()
    rec = dict(req, ok=False, hung=False)
    try:
        stream = client.stream(**req)
        first = None
        async for _ in stream:
            if first is None:
                first = time.perf_counter() - t0
        result = stream.result
        rec.update(ok=True, ttft_s=first, token_ids=list(result.token_ids), attempts=getattr(stream, "attempts", 1))
    except TetherError as e:
        rec.update(code=e.code.name, retry_after=getattr(e, "retry_after", None), answered_s=time.perf_counter() - t0,
                   attempts=getattr(e, "attempts", 1), message=str(e)[:200])
        if e.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.perf_counter() - t0 > deadline_s + GRACE_S:
            rec["hung"] = True
    return rec


async def open_loop(target: str, rate: float, duration: float, seed: int, retry, deadline_s: float,
                    during=None, tenants: tuple[str, ...] = TENANTS) -> list[dict]:
    rng = random.Random(seed)
    async with AsyncClient(target, timeout=deadline_s, retry=retry) as client:
        tasks, t, i = [], 0.0, 0
        start = time.perf_counter()
        hook = asyncio.create_task(during()) if during else None
        while t < duration:
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, request(i, rng, tenants), deadline_s)))
            i += 1
            t += rng.expovariate(rate)
        done = await asyncio.wait_for(asyncio.gather(*tasks), deadline_s + GRACE_S * 2)
        if hook:
            await hook
        return done


async def saturation(target: str, concurrency: int, n: int) -> float:
    rng = random.Random(1)
    async with AsyncClient(target, timeout=120, retry=None) as client:
        reqs = [dict(request(i, rng), priority="standard", tenant="app") for i in range(n)]
        queue = list(reqs)
        t0 = time.perf_counter()

        async def user():
            while queue:
                await one(client, queue.pop(), 120)
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0)


def summarize(records: list[dict]) -> dict:
    out = {}
    groups = [(f"priority={p}", lambda r, p=p: r["priority"] == p) for p, _ in PRIORITIES]
    groups += [(f"tenant={t}", lambda r, t=t: r["tenant"] == t) for t in TENANTS]
    groups += [(f"tenant=app,priority={p}", lambda r, p=p: r["tenant"] == "app" and r["priority"] == p)
               for p, _ in PRIORITIES]
    for name, pick in groups:
        rs = [r for r in records if pick(r)]
        refused = [r for r in rs if not r["ok"]]
        out[name] = dict(
            sent=len(rs), served=len(rs) - len(refused), hung=sum(r["hung"] for r in rs),
            refused_by_code={c: sum(1 for r in refused if r.get("code") == c) for c in {r.get("code") for r in refused}},
            refused_with_retry_info=sum(1 for r in refused if r.get("retry_after")),
            refusal_ms_p50=_ms(pct([r["answered_s"] for r in refused], 50)),
            refusal_ms_p99=_ms(pct([r["answered_s"] for r in refused], 99)),
            ttft_ms_p50=_ms(pct([r["ttft_s"] for r in rs if r["ok"]], 50)),
            ttft_ms_p99=_ms(pct([r["ttft_s"] for r in rs if r["ok"]], 99)))
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


def audit(records: list[dict], model: str) -> int:
    wrong = 0
    for r in records:
        if r["ok"]:
            want = reference.generate(r["prompt"], model, max_tokens=r["max_tokens"]).token_ids
            wrong += want != r["token_ids"]
    return wrong


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, default=16, help="closed-loop users measuring saturation")
    p.add_argument("--overload", type=float, default=2.0, help="multiple of the saturating rate to offer")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of open-loop arrivals per phase")
    p.add_argument("--deadline", type=float, default=20.0, help="each request's deadline (s)")
    p.add_argument("--max-concurrent", type=int, default=48, help="admission's concurrency cap")
    p.add_argument("--bulk-tokens-per-s", type=float, default=200.0, help="tenant bulk's token bucket")
    p.add_argument("--out", type=Path, default=Path("bench-out/overload/report.json"))
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args()
    tenants = Path(tempfile.mkdtemp()) / "tenants.toml"
    tenants.write_text(f"[tenants.bulk]\ntokens_per_s = {args.bulk_tokens_per_s}\nburst_s = 1\n")
    cluster = LocalCluster(model=args.model, stages=1, pipelines=2, threads=1,
                           log_dir=args.log_dir or Path(tempfile.mkdtemp()),
                           extra={"admission": ["--tenants", str(tenants), "--max-concurrent", str(args.max_concurrent)]})
    cluster.start(timeout=180)
    try:
        sat = asyncio.run(saturation(cluster.target, args.concurrency, 96))
        print(f"saturating rate {sat:.1f} req/s", flush=True)
        over = asyncio.run(open_loop(cluster.target, sat * args.overload, args.duration, 2, None, args.deadline))
        victim = cluster.service("p1-coordinator").address

        async def kill_when_busy() -> None:
            loop_deadline = time.monotonic() + 30
            while time.monotonic() < loop_deadline:
                with grpc.insecure_channel(victim) as ch:
                    running = coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(),
                                                                             timeout=5).running
                if running:
                    cluster.kill("p1-coordinator", signal.SIGKILL)
                    return
                await asyncio.sleep(0.05)

        # tenant app only, below saturation: what fails here failed because of the kill, not a limit
        killed = asyncio.run(open_loop(cluster.target, sat * 0.75, args.duration, 3, True, 60.0, kill_when_busy,
                                       tenants=("app",)))
    finally:
        cluster.stop()
    report = dict(
        saturating_rate=round(sat, 2), offered_rate=round(sat * args.overload, 2), duration_s=args.duration,
        overload=summarize(over), overload_hung=sum(r["hung"] for r in over),
        overload_wrong=audit(over, args.model),
        kill=dict(sent=len(killed), served=sum(r["ok"] for r in killed),
                  succeeded_on_first_retry=sum(1 for r in killed if r["ok"] and r.get("attempts") == 2),
                  succeeded_later=sum(1 for r in killed if r["ok"] and (r.get("attempts") or 1) > 2),
                  failed=sum(1 for r in killed if not r["ok"]),
                  failed_codes=sorted({r.get("code") for r in killed if not r["ok"]} - {None}),
                  wrong=audit(killed, args.model), hung=sum(r["hung"] for r in killed)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
