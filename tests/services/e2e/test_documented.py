"""Behaviour the docs promise, each held by a test: tenant namespaces, stop sequences through the service,
Coordinator.Cancel and Admission.Tag."""

from __future__ import annotations

import threading

import grpc
import pytest

from tether import reference
from tether.client import Client, TetherError
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc


def test_tenants_are_namespaces_same_answer_different_chains(cluster, held):
    prompt = "Explain in under 30 words why the sky is blue."
    with Client(cluster.target, timeout=120) as client:
        a = client.generate(prompt, max_tokens=8, tenant="acme")
        b = client.generate(prompt, max_tokens=8, tenant="globex")
    want_a = reference.generate(prompt, max_tokens=8, namespace="acme")
    want_b = reference.generate(prompt, max_tokens=8, namespace="globex")
    assert a.token_ids == b.token_ids == want_a.token_ids           # the model's answer does not depend on it
    assert a.receipt.context_hash == want_a.receipt.context_hash    # each chain is salted with its tenant
    assert b.receipt.context_hash == want_b.receipt.context_hash
    assert a.receipt.context_hash != b.receipt.context_hash         # so no state or cache key is ever shared


def test_stop_sequences_end_the_answer_through_the_service(cluster):
    prompt, params = "Tell me a story", dict(max_tokens=60, temperature=1.0, seed=5)
    full = reference.generate(prompt, **params)
    # two printable ASCII characters the answer is known to contain, past its start
    stop = next(full.text[i:i + 2] for i in range(5, len(full.text) - 1)
                if full.text[i:i + 2].isascii() and full.text[i:i + 2].isprintable())
    want = reference.generate(prompt, stop=[stop], **params)
    with Client(cluster.target, timeout=120) as client:
        got = client.generate(prompt, stop=[stop], **params)
    assert want.finish_reason == "stop" and stop not in want.text
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_coordinator_cancel_ends_the_stream_and_frees_the_request(cluster, wait_released):
    started = threading.Event()
    outcome: list = []
    internal: list[str] = []

    def run() -> None:
        with Client(cluster.target, timeout=120) as client:
            stream = client.stream("cancel me", max_tokens=1500, ignore_eos=True)
            try:
                for _ in stream:
                    if not started.is_set():
                        internal.append(stream.internal_id)
                        started.set()
                outcome.append("finished")
            except TetherError as e:
                outcome.append(e)

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(120)
    with grpc.insecure_channel(cluster.service("coordinator").address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        assert stub.Cancel(coordinator_pb2.CancelRequest(request_id=internal[0]), timeout=10).found
        assert not stub.Cancel(coordinator_pb2.CancelRequest(request_id=internal[0]), timeout=10).found
        assert not stub.Cancel(coordinator_pb2.CancelRequest(request_id="never-was"), timeout=10).found
    t.join(60)
    assert not t.is_alive()
    (e,) = outcome
    assert isinstance(e, TetherError) and e.code == grpc.StatusCode.CANCELLED and "cancelled" in e.message
    wait_released(cluster, internal[0])


@pytest.mark.parametrize("prompt, expect", [
    ("请用不超过50字向老人解释血糖仪读数", dict(language="zh", length_limit=50, length_unit="chars",
                                           domain="medical", audience="elderly")),
    ("Summarize this contract in under 50 words", dict(language="en", task="summarize", length_limit=50,
                                                      length_unit="words", domain="legal")),
])
def test_admission_tag_is_a_dry_run(cluster, prompt, expect):
    with Client(cluster.target, timeout=60) as client:
        tags = client.tag(prompt, max_tokens=400, tenant="acme", priority="critical")
    for k, v in expect.items():
        assert tags[k] == v, (k, tags)
    assert tags["tenant"] == "acme" and tags["priority"] == "critical"
    assert 0 < tags["output_budget"] < 400 and tags["input_tokens"] == len(prompt.encode())
