"""Each explicit ending of the recovery paths, forced end to end and checked with its details: the rebuild
budget ends in ABORTED, KV capacity in RESOURCE_EXHAUSTED; an idle pipeline keeps its streams through the
coordinator's keep-alives, which every stage forwards."""

from __future__ import annotations

import time

import grpc
import pytest

from tether.cli.cluster import LocalCluster
from tether.client import Client, TetherError
from tether.v1 import stage_pb2, stage_pb2_grpc
from tests.helpers import coordinator_stats, started

IDLE_S = 1.5


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """stage0 holds at most 128 KV tokens; stage1 corrupts every token it samples; streams idle out fast."""
    idle = ["--stream-idle", str(IDLE_S)]
    with started(tmp_path_factory, extra={"stage": idle, "coordinator": idle}) as c:
        yield c


def _stage_stats(cluster: LocalCluster, name: str) -> stage_pb2.StageStats:
    with grpc.insecure_channel(cluster.service(name).address) as ch:
        return stage_pb2_grpc.StageStub(ch).Stats(stage_pb2.StageStatsRequest(), timeout=5)


def test_an_idle_pipeline_keeps_its_streams_through_forwarded_keepalives(hostile):
    with Client(hostile.target, timeout=60, retry=None) as client:
        client.generate("wake up", max_tokens=2)
    before = coordinator_stats(hostile).pipeline_reconnects
    end = time.monotonic() + 4 * IDLE_S
    while time.monotonic() < end:          # idle for several idle timeouts, watching the last hop's stream
        assert _stage_stats(hostile, "stage1").forward_streams == 1, "stage0's stream to stage1 idled out"
        assert _stage_stats(hostile, "stage0").forward_streams == 1, "the coordinator's stream idled out"
        time.sleep(IDLE_S / 5)
    assert coordinator_stats(hostile).pipeline_reconnects == before


def _restart_with(cluster: LocalCluster, name: str, *args: str) -> None:
    svc = cluster.service(name)
    cluster.kill(name)
    svc.argv = [*svc.argv, *args]
    cluster.restart(name)


def _refusal(client: Client, prompt: str) -> TetherError:
    """The request's explicit failure, once the pipeline is back (while admission still reports the restart
    it answers UNAVAILABLE "not ready": wait that out, it is the readiness poll catching up)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            client.generate(prompt, max_tokens=4)
        except TetherError as e:
            if not (e.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline):
                return e
            time.sleep(0.2)
            continue
        raise AssertionError("the request succeeded through a stage that corrupts every token")


def test_the_rebuild_budget_ends_in_aborted_and_a_context_beyond_the_kv_pool_in_resource_exhausted(hostile):
    _restart_with(hostile, "stage1", "--faults", "corrupt=1,seed=3")
    _restart_with(hostile, "stage0", "--kv-capacity", "128")
    with Client(hostile.target, timeout=120, retry=None) as client:
        e = _refusal(client, "short")
        assert e.code == grpc.StatusCode.ABORTED, e.message
        assert "could not be verified after 5 rebuilds" in e.message and "TOKEN_HASH_MISMATCH" in e.message
        e = _refusal(client, "x" * 300)                        # 5 KV blocks of 64 > 128 positions
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e.message
        # refused up front by the coordinator's block ledger, not by a stage after five replays
        assert "context positions of KV" in e.message and "at most 128" in e.message
    stats = coordinator_stats(hostile)
    assert stats.rejections["TOKEN_HASH_MISMATCH"] >= 6 and stats.rejections["NO_CAPACITY"] == 0   # try + 5 rebuilds
    assert _stage_stats(hostile, "stage0").requests_held == 0
