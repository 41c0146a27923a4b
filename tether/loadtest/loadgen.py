"""The load generator: open loop (Poisson arrivals at a fixed rate) or closed loop (fixed concurrency) over
`AsyncClient.stream`, timing every token of every request.

Open loop sends on schedule whatever the server's state, so queueing shows up in the latencies (the honest
way to measure a server); closed loop waits for an answer before sending the next request, so it measures
the throughput a fixed number of users get.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tether.loadtest.records import RequestRecord
from tether.loadtest.workloads import BenchRequest
from tether.client import AsyncClient, TetherError


@dataclass(frozen=True)
class Level:
    """One load level: open loop at `rate` requests/s, or closed loop at `concurrency`."""

    mode: str                    # "open" | "closed"
    rate: float = 0.0
    concurrency: int = 0

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}/s" if self.mode == "open" else f"concurrency {self.concurrency}"


@dataclass(frozen=True)
class Budget:
    """When a level stops sending: after `num_requests` requests, or once `duration_s` has passed."""

    num_requests: int | None = None
    duration_s: float | None = None

    def allows(self, sent: int, elapsed: float) -> bool:
        if self.num_requests is not None:
            return sent < self.num_requests
        return elapsed < (self.duration_s or 0.0)


@dataclass
class LevelRun:
    level: Level
    records: list[RequestRecord]
    wall_s: float                # from the level's start to its last completion


OnDone = Callable[[RequestRecord], None]


async def run_request(client: AsyncClient, req: BenchRequest, label: str, t0: float) -> RequestRecord:
    """Send one request and time it: TTFT at the first token, ITL between tokens, E2E at the stream's end."""
    rec = RequestRecord(req, label)
    start = time.perf_counter()
    rec.start = start - t0
    last = start
    stream = client.stream(req.prompt, **req.params())
    try:
        async for _ in stream:
            now = time.perf_counter()
            if rec.ttft is None:
                rec.ttft = now - start
            else:
                rec.itl.append(now - last)
            last = now
    except TetherError as e:
        # The partial answer of a failed request is not kept: a failure counts by its status, never as tokens.
        rec.error_code, rec.error = e.code.name, e.message
        rec.ttft, rec.itl = None, []
        rec.tags = stream.tags
        return rec
    rec.e2e = time.perf_counter() - start
    result = stream.result
    assert result is not None   # the stream ended without an error: it has its result
    rec.token_ids, rec.text, rec.finish_reason = list(result.token_ids), result.text, result.finish_reason
    rec.seed, rec.tags = result.seed, result.tags
    rec.prompt_tokens, rec.context_hash = result.receipt.prompt_tokens, result.receipt.context_hash
    rec.model_fingerprint = result.receipt.model_fingerprint
    return rec


def arrival_times(rng: random.Random, rate: float, budget: Budget) -> Iterator[float]:
    """Send times (seconds after the level's start) of a Poisson process at `rate`.

    With a request count the process is conditioned on that count: the arrivals are uniform over count/rate
    seconds. The burstiness stays Poisson's, but the offered rate is the nominal one; an unconditioned sample
    of 48 requests strays up to 30% from its rate, which would blur a sweep. With a duration: exponential gaps.
    """
    if budget.num_requests is not None:
        window = budget.num_requests / rate
        yield from sorted(rng.uniform(0.0, window) for _ in range(budget.num_requests))
        return
    t = 0.0
    while budget.allows(0, t):
        yield t
        t += rng.expovariate(rate)


async def open_loop(client: AsyncClient, requests: Iterator[BenchRequest], level: Level, budget: Budget,
                    arrivals: random.Random, on_done: OnDone) -> LevelRun:
    """Send at Poisson arrival times (see `arrival_times`), whatever the server's state."""
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[RequestRecord]] = []

    async def one(req: BenchRequest) -> RequestRecord:
        rec = await run_request(client, req, level.label, t0)
        on_done(rec)
        return rec

    for due in arrival_times(arrivals, level.rate, budget):
        await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(next(requests))))
    records = list(await asyncio.gather(*tasks))
    return LevelRun(level, records, time.perf_counter() - t0)


async def closed_loop(client: AsyncClient, requests: Iterator[BenchRequest], level: Level, budget: Budget,
                      on_done: OnDone) -> LevelRun:
    """`concurrency` users, each sending its next request as soon as its previous one ended."""
    t0 = time.perf_counter()
    records: list[RequestRecord] = []
    sent = 0

    async def user() -> None:
        nonlocal sent
        while budget.allows(sent, time.perf_counter() - t0):
            sent += 1
            rec = await run_request(client, next(requests), level.label, t0)
            records.append(rec)
            on_done(rec)

    await asyncio.gather(*(user() for _ in range(level.concurrency)))
    return LevelRun(level, records, time.perf_counter() - t0)


async def run_level(client: AsyncClient, requests: Iterator[BenchRequest], level: Level, budget: Budget,
                    seed: str, on_done: OnDone) -> LevelRun:
    if level.mode == "open":
        return await open_loop(client, requests, level, budget, random.Random(f"arrivals:{seed}"), on_done)
    return await closed_loop(client, requests, level, budget, on_done)
