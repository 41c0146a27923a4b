"""The load generator's timing and pacing, against a fake client that answers on a known schedule.

The machine is shared: sleeps overshoot by unknown amounts. So timings are checked against what the fake
recorded it actually did (its own clock stamps), and pacing against the schedule it was given (never early),
not against absolute bounds."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import grpc
import pytest

from tether.loadtest import loadgen
from tether.loadtest.workloads import BenchRequest
from tether.client import TetherError
from tether.types import Delta, GenerateResult, Receipt

TOKEN_GAP = 0.01


class FakeStream:
    """Three tokens TOKEN_GAP apart after a first-token delay, or a failure after one token."""

    def __init__(self, client: "FakeClient", prompt: str, fail: bool) -> None:
        self.client, self.prompt, self.fail = client, prompt, fail
        self.tags = {"output_budget": 3}
        self.seed = 77
        self.result: GenerateResult | None = None
        self.yielded_at: list[float] = []    # perf_counter stamps of each token handed out (loadgen's clock)
        client.streams.append(self)

    async def __aiter__(self):
        self.client.in_flight += 1
        self.client.peak = max(self.client.peak, self.client.in_flight)
        try:
            await asyncio.sleep(self.client.first_token)
            for i in range(3):
                if i:
                    await asyncio.sleep(TOKEN_GAP)
                self.yielded_at.append(time.perf_counter())
                yield Delta(i, 65 + i, "x", "length" if i == 2 else "")
                if self.fail:
                    raise TetherError("pipeline failed", grpc.StatusCode.UNAVAILABLE)
        finally:
            self.client.in_flight -= 1
        self.result = GenerateResult("xxx", [65, 66, 67], "length", Receipt("r", 1, 4, 99, 3, "fp"),
                                     self.tags, self.seed)


class FakeClient:
    def __init__(self, first_token: float = 0.05) -> None:
        self.first_token = first_token
        self.in_flight = self.peak = 0
        self.sent_at: list[float] = []
        self.streams: list[FakeStream] = []

    def stream(self, prompt: str, **params) -> FakeStream:
        self.sent_at.append(time.perf_counter())
        return FakeStream(self, prompt, fail=prompt == "fail")


def requests(prompt: str = "hi"):
    i = 0
    while True:
        yield BenchRequest(i, "single", prompt, 3)
        i += 1


def test_a_request_is_timed_token_by_token():
    client = FakeClient(first_token=0.05)
    rec = asyncio.run(loadgen.run_request(client, next(requests()), "L", 0.0))
    assert rec.ok and rec.token_ids == [65, 66, 67] and rec.seed == 77 and rec.prompt_tokens == 4
    (stream,) = client.streams
    at, sent = stream.yielded_at, client.sent_at[0]
    # Measured from just before the call: at least the fake's own first-token time, and no more than a few
    # ms over it (the loadgen reads its clock as soon as the token is handed over).
    assert at[0] - sent <= rec.ttft <= at[0] - sent + 0.005
    assert rec.ttft >= 0.05 and all(g >= TOKEN_GAP for g in rec.itl)          # sleeps never run short
    assert len(rec.itl) == 2
    for gap, (a, b) in zip(rec.itl, zip(at, at[1:])):
        assert gap == pytest.approx(b - a, abs=0.005)
    assert rec.ttft + sum(rec.itl) <= rec.e2e <= rec.ttft + sum(rec.itl) + 0.005
    assert rec.tpot == pytest.approx((rec.e2e - rec.ttft) / 2)


def test_a_failed_request_counts_by_status_without_its_partial_tokens():
    rec = asyncio.run(loadgen.run_request(FakeClient(), next(requests("fail")), "L", 0.0))
    assert not rec.ok and rec.error_code == "UNAVAILABLE" and "pipeline failed" in rec.error
    assert rec.token_ids == [] and rec.ttft is None and rec.itl == []


def test_open_loop_sends_at_poisson_times_whatever_the_latency():
    client = FakeClient(first_token=0.2)    # slower than the gaps: requests overlap, sending does not wait
    done = []
    budget = loadgen.Budget(num_requests=60)
    run = asyncio.run(loadgen.open_loop(client, requests(), loadgen.Level("open", rate=100.0), budget,
                                        random.Random(1), done.append))
    assert len(run.records) == len(done) == 60 and client.peak > 10
    schedule = list(loadgen.arrival_times(random.Random(1), 100.0, budget))   # what it was told to follow
    starts = sorted(r.start for r in run.records)
    assert all(start >= due for start, due in zip(starts, schedule))           # never early
    assert run.wall_s >= schedule[-1] + 0.2                                    # the last one still ran its time


def test_closed_loop_keeps_exactly_its_concurrency():
    client = FakeClient(first_token=0.02)
    run = asyncio.run(loadgen.closed_loop(client, requests(), loadgen.Level("closed", concurrency=3),
                                          loadgen.Budget(num_requests=10), lambda r: None))
    assert len(run.records) == 10 and client.peak == 3


def test_a_duration_budget_stops_sending_in_time():
    client = FakeClient(first_token=0.01)
    run = asyncio.run(loadgen.run_level(client, requests(), loadgen.Level("closed", concurrency=2),
                                        loadgen.Budget(duration_s=0.3), "s", lambda r: None))
    assert 2 <= len(run.records) <= 24          # 2 users x at least ~0.03 s a request: at most 11 each
    assert max(r.start for r in run.records) < 0.3 + 0.05   # nothing starts once the budget is spent


def test_level_labels():
    assert loadgen.Level("open", rate=2.5).label == "rate 2.5/s"
    assert loadgen.Level("closed", concurrency=8).label == "concurrency 8"


def test_arrival_times_of_a_counted_level_fill_exactly_its_window():
    times = list(loadgen.arrival_times(random.Random(0), 4.0, loadgen.Budget(num_requests=48)))
    assert len(times) == 48 and times == sorted(times)
    assert 0 <= times[0] and times[-1] <= 12.0
    assert (len(times) - 1) / (times[-1] - times[0]) == pytest.approx(4.0, rel=0.1)   # the nominal rate
    # the same seed at another rate is the same pattern, scaled: levels of a sweep differ only in load
    assert list(loadgen.arrival_times(random.Random(0), 8.0, loadgen.Budget(num_requests=48))) == \
        pytest.approx([t / 2 for t in times])


def test_arrival_times_of_a_timed_level_are_a_poisson_process():
    times = list(loadgen.arrival_times(random.Random(0), 50.0, loadgen.Budget(duration_s=20.0)))
    assert times[0] == 0.0 and max(times) < 20.0
    assert len(times) == pytest.approx(1000, rel=0.1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)    # exponential: sd = mean
