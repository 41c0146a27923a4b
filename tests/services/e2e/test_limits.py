"""Limits each service enforces itself: a request lifetime when the caller sets none, admission's own message
size and concurrency cap (RESOURCE_EXHAUSTED with RetryInfo), and no forwarding while admission is not ready
(coordinator gone, or serving another model)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest

from tether import reference, settings
from tether.cli.cluster import LocalCluster, free_port
from tether.client import Client, TetherError
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.helpers import stage_stats, started

LIFETIME_S = 4.0


@pytest.fixture(scope="module")
def short_lived(tmp_path_factory):
    lifetime = ["--max-request-seconds", str(LIFETIME_S)]
    with started(tmp_path_factory,
                 extra={"admission": [*lifetime, "--max-concurrent", "2"], "coordinator": lifetime}) as c:
        yield c


def _stages_hold(cluster: LocalCluster) -> list[int]:
    return [s.requests_held for s in stage_stats(cluster)]


def _until(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def test_a_call_without_deadline_ends_at_the_lifetime_and_frees_its_state(short_lived):
    with Client(short_lived.target, retry=None) as client:         # timeout=None: no deadline from the caller
        t0 = time.monotonic()
        with pytest.raises(TetherError) as info:
            client.generate("go on forever", max_tokens=2000, ignore_eos=True)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "maximum lifetime" in info.value.message
    assert time.monotonic() - t0 < LIFETIME_S + 15
    _until(lambda: _stages_hold(short_lived) == [0, 0], what="the stages to release the request")


def test_the_coordinator_applies_its_own_lifetime_to_a_peer_without_deadline(short_lived):
    with grpc.insecure_channel(short_lived.service("coordinator").address) as ch:
        call = coordinator_pb2_grpc.CoordinatorStub(ch).Submit(coordinator_pb2.SubmitRequest(
            request_id="no-deadline", prompt_token_ids=[72, 105],
            sampling=common_pb2.SamplingParams(max_tokens=2000, ignore_eos=True)))
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "coordinator's maximum lifetime" in info.value.details()
    _until(lambda: _stages_hold(short_lived) == [0, 0], what="the stages to release the request")


def test_over_the_concurrency_cap_is_resource_exhausted_with_retry_info(short_lived):
    started = threading.Barrier(3, timeout=60)
    stop = threading.Event()

    def hold() -> None:
        with Client(short_lived.target, timeout=60, retry=None) as client:
            try:
                for k, _ in enumerate(client.stream("hold a slot", max_tokens=2000, ignore_eos=True)):
                    if k == 0:
                        started.wait()
                    if stop.is_set():
                        break
            except TetherError:
                pass   # the lifetime may end it first; the slot was held while it mattered

    holders = [threading.Thread(target=hold) for _ in range(2)]
    for t in holders:
        t.start()
    try:
        started.wait()                                      # both slots taken, both mid-generation
        with Client(short_lived.target, timeout=30, retry=None) as client:
            with pytest.raises(TetherError) as info:
                client.generate("one more", max_tokens=2)
    finally:
        stop.set()
        for t in holders:
            t.join(30)
    e = info.value
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 2 concurrent" in e.message
    assert e.retry_after == settings.OVERLOAD_RETRY_AFTER_S    # parsed from the RetryInfo detail on the wire


def test_admission_takes_messages_sized_to_its_prompt_cap(short_lived):
    with Client(short_lived.target, timeout=30, retry=None) as client:
        with pytest.raises(TetherError) as info:          # bigger than admission's own message limit
            client.generate("x" * (settings.ADMISSION_MAX_MESSAGE_BYTES + 1))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_admission_for_another_model_never_forwards(short_lived, tmp_path):
    port = free_port()
    log = open(tmp_path / "admission-small.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.admission", "--port", str(port), "--model", "small",
                             "--coordinator", short_lived.service("coordinator").address, "--no-http"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        def refusal():
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                    admission_pb2_grpc.AdmissionStub(ch).Generate(
                        admission_pb2.GenerateRequest(prompt=b"hi", sampling=common_pb2.SamplingParams(max_tokens=2)),
                        timeout=10)
            except grpc.RpcError as e:
                return e if "serves model" in (e.details() or "") else None
            raise AssertionError("admission for another model forwarded a request")
        err = _until(refusal, timeout=120, what="the mismatched admission's refusal")
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in err.details()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def test_admission_refuses_while_its_coordinator_is_down_and_serves_again_after(short_lived):
    short_lived.kill("coordinator")
    try:
        def refusal():
            with Client(short_lived.target, timeout=10, retry=None) as client:
                try:
                    client.generate("hello", max_tokens=2)
                except TetherError as e:
                    return e if "not ready" in e.message else None
            raise AssertionError("admission answered with its coordinator dead")
        err = _until(refusal, what="admission to notice its coordinator is gone")
        assert err.code == grpc.StatusCode.UNAVAILABLE and "coordinator unreachable" in err.message
        with Client(short_lived.target, timeout=30, retry=None) as client:   # a dry run needs no coordinator
            assert client.tag("不超过50字")["length_limit"] == 50
    finally:
        short_lived.restart("coordinator")
    short_lived.wait_ready(120)
    with Client(short_lived.target, timeout=60, retry=None) as client:
        got = client.generate("hello again", max_tokens=6)
    assert got.token_ids == reference.generate("hello again", "tiny", max_tokens=6).token_ids
