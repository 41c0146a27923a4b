"""Bad input gets the right status and a message a person understands; a dead stage fails requests fast."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tether import reference
from tether.cli.cluster import LocalCluster
from tether.client import Client, TetherError
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2
from tests.helpers import coordinator_stats


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
    with Client(cluster.target, retry=None) as client:
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


def _start_streams(cluster, n: int, max_tokens: int):
    """n streaming requests in threads; returns (threads, results, errors, barrier passed once all started)."""
    started = threading.Barrier(n + 1, timeout=60)
    results: list = [None] * n
    errors: list[BaseException | None] = [None] * n

    def run(i: int) -> None:
        with Client(cluster.target, timeout=180, retry=None) as client:
            try:
                stream = client.stream(f"long request {i}", max_tokens=max_tokens, ignore_eos=True,
                                       temperature=1.0, seed=i + 1)
                for k, _ in enumerate(stream):
                    if k == 0:
                        started.wait()
                results[i] = stream.result
            except BaseException as e:  # noqa: BLE001 - recorded and asserted below
                errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait()                       # every request has produced a token: all are mid-generation
    return threads, results, errors


def test_stage_that_stays_dead_fails_in_flight_requests_with_unavailable(tmp_path):
    window = 3.0
    cluster = LocalCluster(model="tiny", stages=2, threads=1, log_dir=tmp_path,
                           extra={"coordinator": ["--recovery-window", str(window)]}).start(timeout=180)
    try:
        threads, _, errors = _start_streams(cluster, 4, max_tokens=2000)
        t0 = time.monotonic()
        cluster.kill("stage1")
        for t in threads:
            t.join(timeout=60)
        elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "a request hung after its stage died"
        for e in errors:
            assert isinstance(e, TetherError), e
            assert e.code == grpc.StatusCode.UNAVAILABLE, (e.code, e.message)
        assert elapsed < window + 20, f"failures took {elapsed:.1f}s"
    finally:
        cluster.stop()


def test_stage_killed_and_restarted_mid_generation_requests_complete_exactly(tmp_path):
    cluster = LocalCluster(model="tiny", stages=2, threads=1, log_dir=tmp_path).start(timeout=180)
    try:
        n, max_tokens = 4, 300
        threads, results, errors = _start_streams(cluster, n, max_tokens)
        cluster.kill("stage1")            # SIGKILL: its KV state is gone
        cluster.restart("stage1")         # the coordinator re-handshakes, syncs and replays
        for t in threads:
            t.join(timeout=170)
        assert not any(t.is_alive() for t in threads)
        assert errors == [None] * n, errors
        for i, got in enumerate(results):
            want = reference.generate(f"long request {i}", max_tokens=max_tokens, ignore_eos=True,
                                      temperature=1.0, seed=i + 1)
            assert got.token_ids == want.token_ids
        stats = coordinator_stats(cluster)
        assert stats.pipeline_reconnects >= 1 and stats.rebuilds >= 1 and stats.recovered >= 1
    finally:
        cluster.stop()
