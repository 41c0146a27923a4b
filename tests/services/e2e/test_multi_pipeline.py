"""Several pipelines behind one admission (issue 12): requests spread over them by the router, every answer
exact, each coordinator streaming its load over Watch, and a pipeline killed under load: its breaker opens,
traffic moves to the other, and what was in flight on it is continued there by admission (docs/PROTOCOL.md
"Resume"), exactly."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.request

import grpc
import pytest

from tether import reference
from tether.client import AsyncClient
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.helpers import started, wait_admission_routes_every_pipeline

PROMPTS = ["Explain in under 30 words why the sky is blue.", "写一首关于秋天的短诗", "def fib(n):",
           "Summarize: the quick brown fox jumps over the lazy dog.", "你好", "A" * 200]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    with started(tmp_path_factory, stages=1, pipelines=2, metrics=True,
                 log_dir=tmp_path_factory.mktemp("two-pipelines")) as c:
        wait_admission_routes_every_pipeline(c)   # the spread test needs admission to see both
        yield c


def _cases(n: int, tag: str) -> list[dict]:
    return [dict(prompt=f"{PROMPTS[i % len(PROMPTS)]} {tag}{i}", max_tokens=4 + i % 13) for i in range(n)]


def _exact(case: dict, got) -> None:
    want = reference.generate(case["prompt"], "tiny", max_tokens=case["max_tokens"])
    assert got.token_ids == want.token_ids and got.receipt.context_hash == want.receipt.context_hash, case


async def _generate_all(target: str, cases: list[dict], retry=True):
    async with AsyncClient(target, timeout=120, retry=retry) as client:
        return await asyncio.gather(*(client.generate(**c) for c in cases))


def test_watch_streams_each_pipelines_load(two):
    for name in ("coordinator", "p1-coordinator"):
        with grpc.insecure_channel(two.service(name).address) as ch:
            call = coordinator_pb2_grpc.CoordinatorStub(ch).Watch(coordinator_pb2.WatchRequest(interval_s=0.05),
                                                                  timeout=10)
            reports = [next(call) for _ in range(3)]
            call.cancel()
        assert all(r.serving and r.model_fingerprint and r.kv_blocks_total > 0 and r.max_context > 0
                   for r in reports), reports


def test_requests_spread_over_both_pipelines_and_stay_exact(two):
    cases = _cases(24, "spread")
    results = asyncio.run(_generate_all(two.target, cases))
    for case, got in zip(cases, results):
        _exact(case, got)
        assert got.tags["route_reason"], got.tags
    used = {r.tags["pipeline"] for r in results}
    # named in --coordinator's order (pipeline 0's coordinator first), never by address
    assert used == {"pipeline-0", "pipeline-1"}, used


def _running(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).Stats(coordinator_pb2.StatsRequest(), timeout=5).running


def test_a_pipeline_killed_under_load_moves_traffic_and_loses_no_answer(two):
    """SIGKILL pipeline 1's coordinator while it runs requests: nothing wrong, nothing lost. Admission continues
    its requests on pipeline 0 after the tokens they had (no retry at the client); later requests go there
    directly."""
    victim = two.service("p1-coordinator").address
    cases = [dict(c, max_tokens=40) for c in _cases(32, "kill")]
    outcome: dict = {}

    def send() -> None:
        outcome["results"] = asyncio.run(_generate_all(two.target, cases))

    t = threading.Thread(target=send)
    t.start()
    deadline = time.monotonic() + 60
    while _running(victim) == 0:          # kill it while it holds requests, not before or after
        assert time.monotonic() < deadline and t.is_alive(), "pipeline 1 never ran a request"
        time.sleep(0.02)
    two.kill("p1-coordinator", signal.SIGKILL)
    t.join(timeout=300)
    assert not t.is_alive()
    results = outcome["results"]
    for case, got in zip(cases, results):
        _exact(case, got)
    metrics = urllib.request.urlopen(two.service("admission").metrics_url, timeout=5).read().decode()
    assert 'tether:requests_resumed_total{reason="session_broken"}' in metrics, "nothing was resumed"
    assert max(r.attempts for r in results) == 1      # admission hid the failure: the SDK never retried
    after = _cases(8, "after")
    results = asyncio.run(_generate_all(two.target, after, retry=False))
    for case, got in zip(after, results):
        _exact(case, got)
        assert got.tags["pipeline"] == "pipeline-0", got.tags   # the survivor
