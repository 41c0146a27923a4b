"""A pipeline whose stages do not assemble exactly refuses to serve and says which stage and why."""

from __future__ import annotations

import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether.cli.cluster import LocalCluster, Service, free_port
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc, common_pb2
from tests.helpers import second_dtype


def _start(tmp_path, stage_specs: list[tuple[str, ...]]) -> LocalCluster:
    """Stages with explicit (model, layers, *more flags) plus a coordinator (--dtype auto) over them; no admission."""
    c = LocalCluster(model="tiny", log_dir=tmp_path)
    py = [sys.executable, "-m"]
    for i, (model, layers, *more) in enumerate(stage_specs):
        port = free_port()
        c.services.append(Service(f"stage{i}", py + ["services.stage_worker", "--port", str(port), "--model", model,
                                                     "--layers", layers, "--threads", "1", *more], f"127.0.0.1:{port}"))
    route = ",".join(s.address for s in c.services)
    port = free_port()
    c.services.append(Service("coordinator", py + ["services.coordinator", "--port", str(port), "--model", "tiny",
                                                   "--stages", route], f"127.0.0.1:{port}"))
    for s in c.services:
        c.spawn(s)
    return c


def _refusal(c: LocalCluster, timeout: float = 120.0) -> str:
    """Poll the coordinator until it reports a refused pipeline; return its status line."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(c.service("coordinator").address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        while time.monotonic() < deadline:
            try:
                stats = stub.Stats(coordinator_pb2.StatsRequest(), timeout=2)
                assert not stats.serving, f"pipeline served: {stats.status}"
                if stats.status.startswith("pipeline refused:"):
                    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                    with pytest.raises(grpc.RpcError) as info:
                        list(stub.Submit(coordinator_pb2.SubmitRequest(
                            request_id="probe", prompt_token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=10))
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert stats.status in info.value.details()
                    return stats.status
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError("coordinator never reported the refusal\n" + c.service("coordinator").log_tail())


@pytest.mark.parametrize("specs, words", [
    ([("tiny", "0:2"), ("tiny", "3:4")], ["stage 1", "gap"]),
    ([("tiny", "0:3"), ("tiny", "2:4")], ["stage 1", "overlap"]),
    ([("tiny", "0:2"), ("tiny", "2:3")], ["stage 1", "lacks the head"]),
    ([("tiny", "0:2"), ("small", "4:8")], ["stage 1", "model"]),
    ([("tiny", "0:2", "--dtype", "float32"), ("tiny", "2:4", "--dtype", "SECOND")],
     ["stage 1", "runs SECOND", "the stages before it run float32", "never mixes numerics"]),
])
def test_mis_assembled_pipeline_is_refused_with_reason(tmp_path, specs, words):
    if any("SECOND" in spec for spec in specs):   # a dtype besides float32 that this machine serves exactly
        other = second_dtype()
        specs = [tuple(other if a == "SECOND" else a for a in spec) for spec in specs]
        words = [w.replace("SECOND", other) for w in words]
    c = _start(tmp_path, specs)
    try:
        status = _refusal(c)
        for w in words:
            assert w in status, status
    finally:
        c.stop()


def test_a_refused_coordinator_keeps_retrying_and_serves_once_the_route_is_fixed(tmp_path):
    c = _start(tmp_path, [("tiny", "0:2"), ("small", "4:8")])   # stage 1 loaded another model
    try:
        assert "model" in _refusal(c)
        stage1 = c.service("stage1")
        c.kill("stage1")
        stage1.argv[stage1.argv.index("small")] = "tiny"        # the operator fixes it: same address
        stage1.argv[stage1.argv.index("4:8")] = "2:4"
        c.restart("stage1")
        deadline = time.monotonic() + 120
        with grpc.insecure_channel(c.service("coordinator").address) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            while not stub.Stats(coordinator_pb2.StatsRequest(), timeout=5).serving:   # no restart needed
                assert time.monotonic() < deadline, c.service("coordinator").log_tail()
                time.sleep(0.2)
            events = list(stub.Submit(coordinator_pb2.SubmitRequest(
                request_id="after-fix", prompt_token_ids=[72, 105],
                sampling=common_pb2.SamplingParams(max_tokens=3)), timeout=60))
        assert len(events) == 3 and events[-1].finish_reason
    finally:
        c.stop()
