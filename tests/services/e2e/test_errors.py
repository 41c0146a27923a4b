"""Bad input gets the right status and a message a person understands; a dead stage fails requests fast."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tether.cli.cluster import LocalCluster
from tether.client import Client, TetherError
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2


@pytest.mark.parametrize("prompt, params, words", [
    ("", {}, "empty"),
    ("   ", {}, "empty"),
    ("hi", {"max_tokens": 100000}, "max_tokens"),
    ("hi", {"temperature": -1.0}, "temperature"),
    ("hi", {"temperature": float("nan")}, "temperature"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"priority": "urgent"}, "priority"),
    (b"\xff\xfe bad utf-8", {}, "UTF-8"),
    ("x" * 70000, {}, "prompt"),
])
def test_bad_input_is_invalid_argument_with_a_clear_message(cluster, prompt, params, words):
    with Client(cluster.target) as client:
        with pytest.raises(TetherError) as info:
            client.generate(prompt, **params)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert words.lower() in info.value.message.lower(), info.value.message


def test_raw_grpc_status_for_invalid_utf8(cluster):
    """The status on the wire, not just the SDK's view of it."""
    with grpc.insecure_channel(cluster.target) as ch:
        stub = admission_pb2_grpc.AdmissionStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(admission_pb2.GenerateRequest(prompt=b"\xc3\x28",
                                                        sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in info.value.details()


def test_killed_stage_fails_in_flight_requests_promptly_with_unavailable(tmp_path):
    cluster = LocalCluster(model="tiny", stages=2, threads=1, log_dir=tmp_path).start(timeout=180)
    try:
        n = 4
        started = threading.Barrier(n + 1, timeout=60)
        errors: list[BaseException | None] = [None] * n

        def run(i: int) -> None:
            with Client(cluster.target, timeout=120) as client:
                try:
                    for k, _ in enumerate(client.stream(f"long request {i}", max_tokens=2000, ignore_eos=True,
                                                        temperature=1.0, seed=i + 1)):
                        if k == 0:
                            started.wait()
                except BaseException as e:  # noqa: BLE001 - recorded and asserted below
                    errors[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        started.wait()                      # every request has produced a token: all are mid-generation
        t0 = time.monotonic()
        cluster.kill("stage1")
        for t in threads:
            t.join(timeout=60)
        elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "a request hung after its stage died"
        for e in errors:
            assert isinstance(e, TetherError), e
            assert e.code == grpc.StatusCode.UNAVAILABLE, (e.code, e.message)
        assert elapsed < 30, f"failures took {elapsed:.1f}s"
    finally:
        cluster.stop()
