"""Admission's public port names no internals: intent tags name the pipeline by its stable name, and errors say
what the caller can act on plus a reference, while the detail (addresses, the coordinator's words) goes to
admission's log under that reference. A real cluster: a request served, then its stage killed mid-request,
then the requests refused while no pipeline serves.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from services.admission.public import failure_message, names_internals
from tether.cli.cluster import LocalCluster
from tether.client import Client, TetherError
from tests.helpers import started

GRPC_CORE_DETAIL = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50072: Failed to "
                    "connect to remote host: Connection refused")


@pytest.mark.parametrize("detail", [
    GRPC_CORE_DETAIL,
    "pipeline failed during generation: stage 1 (tether-stage-1.tether-stage:50071) did not answer",
    "session stream failed: AioRpcError(<StatusCode.UNAVAILABLE: (14, 'unavailable')>)",
    "stage [::1]:50071 refused the handshake",
    "peer 10.0.3.7 closed the stream",
])
@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED])
def test_a_detail_naming_internals_never_reaches_the_caller(code, detail):
    assert names_internals(detail)
    message = failure_message(code, detail, "abc123")
    assert not names_internals(message) and detail not in message
    assert "request abc123" in message, "the reference that finds the detail in the log"


def test_what_was_said_is_passed_on_without_its_addresses_and_a_bug_says_nothing():
    said = "the request needs 9000 context positions; no pipeline's model holds more than 4096"
    assert failure_message(grpc.StatusCode.INVALID_ARGUMENT, said, "r1").startswith(said + " (details")
    redacted = failure_message(grpc.StatusCode.UNAVAILABLE, GRPC_CORE_DETAIL, "r1")
    assert redacted.startswith("failed to connect to all addresses; last error: UNKNOWN: <internal>: Failed")
    assert failure_message(grpc.StatusCode.INTERNAL, said, "r1").startswith("admission hit an internal error")
    assert failure_message(grpc.StatusCode.UNAVAILABLE, "x: ValueError('boom')", "r1").startswith(
        "the pipeline serving this request became unavailable; retry")


@pytest.fixture(scope="module")
def fragile(tmp_path_factory):
    """A cluster whose coordinator gives up on a dead stage after 3 s (its requests fail UNAVAILABLE)."""
    with started(tmp_path_factory, extra={"coordinator": ["--recovery-window", "3"]}) as c:
        yield c


def _internal_addresses(cluster: LocalCluster) -> list[str]:
    return [s.address for s in cluster.services]


def test_tags_name_the_pipeline_not_its_address(fragile):
    with Client(fragile.target, retry=None) as client:
        got = client.generate("The capital of France is", max_tokens=3)
        tagged = client.tag("The capital of France is", max_tokens=3)
    assert got.tags["pipeline"] == "pipeline-0"
    assert got.tags["route_reason"].startswith("pipeline-0 (")
    for text in (str(got.tags), str(tagged)):
        assert not names_internals(text), text
        assert not any(a in text for a in _internal_addresses(fragile)), text


def test_errors_after_a_stage_dies_say_what_to_do_and_keep_the_detail_in_the_log(fragile):
    errors: list[BaseException] = []
    started = threading.Barrier(3, timeout=60)

    def run(i: int) -> None:
        with Client(fragile.target, timeout=120, retry=None) as client:
            try:
                for k, _ in enumerate(client.stream(f"a long request {i}", max_tokens=2000, ignore_eos=True)):
                    if k == 0:
                        started.wait()
            except BaseException as e:  # noqa: BLE001 - asserted below
                errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait()
    fragile.kill("stage1")
    for t in threads:
        t.join(timeout=90)
    assert len(errors) == 2 and all(isinstance(e, TetherError) for e in errors), errors
    log = fragile.service("admission").log_tail(400)
    for e in errors:
        assert e.code == grpc.StatusCode.UNAVAILABLE
        assert not names_internals(e.message), e.message
        assert "details in admission's log under request " in e.message, e.message
        rid = e.message.rsplit("under request ", 1)[1].rstrip(")")
        (line,) = [ln for ln in log.splitlines() if f"request {rid} " in ln and " failed: " in ln]
        assert fragile.service("coordinator").address in line, "the log keeps the detail the caller did not get"
    # the pipeline is down now: admission refuses new requests, again without naming anything internal
    deadline = time.monotonic() + 60
    with Client(fragile.target, timeout=30, retry=None) as client:
        while True:
            with pytest.raises(TetherError) as info:
                client.generate("hello", max_tokens=2)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert not names_internals(info.value.message), info.value.message
            if "not ready" in info.value.message or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert "admission is not ready" in info.value.message
