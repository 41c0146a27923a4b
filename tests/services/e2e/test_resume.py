"""Resume through the real services: a request that carries the output it already has continues exactly where
the uninterrupted run would, its chunks start after them and its receipt covers prompt + all output; claimed
tokens are checked like a prompt."""

from __future__ import annotations

import grpc
import pytest

from tether import reference
from tether.cli.cluster import Service, free_port, wait_serving
from tether.client import Client
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2, coordinator_pb2, coordinator_pb2_grpc

CASES = [   # prompt, sampling: greedy and seeded, English and Chinese, one with a stop sequence
    ("The quick brown fox", dict(max_tokens=10, ignore_eos=True)),
    ("从前有一座山，山上有", dict(max_tokens=10, temperature=0.8, top_k=40, seed=99, ignore_eos=True)),
    ("Once upon a time", dict(max_tokens=12, temperature=0.7, seed=5, stop=["e "], ignore_eos=True)),
]


def _stream(stub, prompt: str, resume: list[int], **sampling) -> list[admission_pb2.GenerateChunk]:
    request = admission_pb2.GenerateRequest(prompt=prompt.encode(), resume_tokens=resume,
                                            sampling=common_pb2.SamplingParams(**sampling))
    return list(stub.GenerateStream(request, timeout=60))


@pytest.mark.parametrize("prompt, sampling", CASES)
def test_a_resumed_stream_continues_the_uninterrupted_answer_exactly(cluster, prompt, sampling):
    ref = reference.generate(prompt, **sampling)
    n = len(ref.token_ids)
    with grpc.insecure_channel(cluster.target) as ch:
        stub = admission_pb2_grpc.AdmissionStub(ch)
        for at in sorted({1, n // 2, n - 1}):
            chunks = _stream(stub, prompt, ref.token_ids[:at], **sampling)
            assert [c.index for c in chunks] == list(range(at, n))
            assert [c.token_id for c in chunks] == ref.token_ids[at:]
            assert chunks[0].HasField("tags") and chunks[0].internal_id   # this call's first chunk
            receipt = chunks[-1].receipt
            assert receipt.context_hash == ref.receipt.context_hash and receipt.output_tokens == n
            assert common_pb2.FinishReason.Name(chunks[-1].finish_reason).endswith(ref.finish_reason.upper())


def test_resume_tokens_are_checked_like_a_prompt(cluster):
    with grpc.insecure_channel(cluster.target) as ch:
        stub = admission_pb2_grpc.AdmissionStub(ch)
        for resume, sampling, why in [
            ([1 << 20], dict(max_tokens=4), "vocabulary"),
            ([5, 6, 7, 8], dict(max_tokens=4), "max_tokens"),
            ([5], dict(max_tokens=4, temperature=0.5), "seed"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                _stream(stub, "hello", resume, **sampling)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
    with grpc.insecure_channel(cluster.service("coordinator").address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        tok = reference.load("tiny").tokenizer
        for resume, max_tokens, why in [([1 << 20], 4, "vocabulary"), ([5, 6, 7, 8], 4, "max_tokens"),
                                        ([5, *tok.eos_ids], 4, "end the generation")]:
            submit = coordinator_pb2.SubmitRequest(request_id=f"bad-{why}", prompt_token_ids=[5, 6], resume_tokens=resume,
                                                   sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Submit(submit, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()


@pytest.fixture
def two_admissions(cluster, tmp_path):
    """Two more admission replicas in front of the cluster's pipeline (real processes, the same command)."""
    base = cluster.service("admission")
    replicas = []
    for k in range(2):
        port = free_port()
        argv = list(base.argv)
        argv[argv.index("--port") + 1] = str(port)
        if "--http-port" in argv:   # the cluster's admission holds its HTTP port: each replica gets its own
            argv[argv.index("--http-port") + 1] = str(free_port())
        svc = Service(f"admission-r{k}", argv, f"127.0.0.1:{port}")
        cluster.spawn(svc)
        replicas.append(svc)
    try:
        for svc in replicas:
            with grpc.insecure_channel(svc.address) as ch:
                assert wait_serving(ch, 60), svc.log_tail()
        yield replicas
    finally:
        for svc in replicas:
            if svc.proc.poll() is None:
                svc.proc.kill()
            svc.proc.wait(10)


@pytest.mark.parametrize("sampling", [dict(max_tokens=48, ignore_eos=True),
                                      dict(max_tokens=48, temperature=0.8, top_p=0.9, ignore_eos=True)],
                         ids=["greedy", "sampled"])
def test_the_sdk_resumes_a_stream_whose_admission_was_killed_on_another_exactly(two_admissions, sampling):
    first, other = two_admissions
    prompt = "从前有一座山，山上有"
    with Client(targets=[first.address, other.address], timeout=60) as client:
        stream = client.stream(prompt, **sampling)
        deltas = []
        for delta in stream:
            deltas.append(delta)
            if len(deltas) == 1:
                first.proc.kill()       # mid-stream: the iterator must finish on the other admission
    ref = reference.generate(prompt, **{**sampling, "seed": stream.seed})
    assert first.proc.wait(10) == -9 and stream.attempts == 2
    assert [d.index for d in deltas] == list(range(len(ref.token_ids)))      # none repeated, none missing
    assert stream.result.token_ids == ref.token_ids and stream.result.text == ref.text
    assert stream.result.receipt.context_hash == ref.receipt.context_hash
