"""Fault injection wired into live stage workers (--faults / TETHER_FAULTS), and the experiment-only
--unsafe-disable-stamp-checks switch: the same fault gives wrong tokens without the checks, none with them.

The test plays the coordinator: it sends frames itself and, like the coordinator, rebuilds a request
(new epoch, whole context from position 0) when a slot is rejected.
"""

from __future__ import annotations

import time

import grpc
import pytest

from tether import reference
from tether.v1 import stage_pb2

RejectReason = stage_pb2.RejectReason
PROMPTS = [list(b"The quick brown fox"), list("今天天气很好".encode()), list(b"hello world"), list(b"abc")]
STEPS = 6


def params(max_tokens: int = 64):
    return reference.sampling_params(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def expected():
    lm = reference.load("tiny", dtype="float32")   # the stages here run float32 (conftest), whatever auto picks
    return {i: list(reference.generate_ids(lm, p, params(STEPS + 1)).output_ids) for i, p in enumerate(PROMPTS)}


def reasons(reply) -> list[str]:
    return [RejectReason.Name(r.reason) if not r.ok else "ok" for r in reply.results]


def generate(stage, kit, rid_prefix: str, checks: bool = True) -> tuple[dict[int, list[int]], int]:
    """Prefill and decode every prompt for STEPS tokens as a coordinator would; rebuild a rejected request.
    Returns the tokens each request got, and how many slots were rejected."""
    stream = stage.stream()
    reqs = {i: kit.Req(f"{rid_prefix}-{i}", list(p), params=params()) for i, p in enumerate(PROMPTS)}
    got = {i: [] for i in reqs}
    rejected = 0
    for _ in range(STEPS + 1):
        for i, req in reqs.items():       # one request per frame: a rejection then rebuilds only that one
            reply = stream.ask(stream.frame([req.slot()]))
            (res,) = reply.results
            if not res.ok:
                rejected += 1
                req.epoch, req.fed = req.epoch + 1, 0      # rebuild: the whole context again, new epoch
                reply = stream.ask(stream.frame([req.slot()]))
                (res,) = reply.results
                assert res.ok, reasons(reply)
            assert res.has_token and res.stamp.request_id == req.rid
            if checks:   # without them the stage's own chain is as wrong as its state
                assert res.token_hash == req.token_mac(res.token_id)
            req.accept(res.token_id)
            got[i].append(res.token_id)
    assert stream.end() == grpc.StatusCode.OK
    return got, rejected


def test_forgotten_kv_gives_wrong_tokens_only_without_the_checks(start_stage, kit, expected):
    spec = "forget_kv=1,seed=1"
    unsafe = start_stage("--faults", spec, "--unsafe-disable-stamp-checks")
    safe = start_stage("--faults", spec)
    assert "STAMP CHECKS ARE DISABLED" in unsafe.log() and "fault injection ON" in unsafe.log()
    for s in (unsafe, safe):
        s.handshake()

    got, rejected = generate(unsafe, kit, "u", checks=False)
    assert rejected == 0                                    # nothing noticed anything...
    wrong = sum(g != e for i in got for g, e in zip(got[i], expected[i]))
    assert wrong > 0, "forgotten KV without the checks should have answered wrongly (答非所问)"
    assert all(got[i][0] == expected[i][0] for i in got)    # ...prefill (nothing forgotten yet) was right
    st = unsafe.stats()
    assert not st.stamp_checks and dict(st.rejections) == {}
    assert st.faults_injected["forget_kv"] == STEPS * len(PROMPTS)

    got, rejected = generate(safe, kit, "s")
    assert got == expected, "with the checks on, every token is the reference's"
    assert rejected == STEPS * len(PROMPTS)                 # each forgotten state was caught, then rebuilt
    st = safe.stats()
    assert st.stamp_checks and dict(st.rejections) == {"UNKNOWN_REQUEST": rejected}
    assert st.faults_injected["forget_kv"] == rejected


@pytest.fixture(scope="module")
def last(start_stage):
    return start_stage("--layers", "1/2")


def chain(start_stage, last, spec: str):
    first = start_stage("--layers", "0/2", "--faults", spec)
    first.handshake(route=[first, last])
    return first


def prompts_frame(stream, kit, prefix: str, n: int = 3):
    reqs = [kit.Req(f"{prefix}-{i}", list(PROMPTS[i]), params=params()) for i in range(n)]
    return reqs, stream.frame([r.slot() for r in reqs])


def test_corrupted_or_swapped_activations_are_caught_by_the_next_stage(start_stage, last, kit):
    for spec, kind in [("corrupt=1,seed=3", "corrupt"), ("swap_slots=1,seed=3", "swap_slots")]:
        first = chain(start_stage, last, spec)
        stream = first.stream()
        before = last.stats().rejections.get("DIGEST_MISMATCH", 0)
        for k in range(3):
            reqs, frame = prompts_frame(stream, kit, f"{kind}{k}")
            reply = stream.ask(frame)
            assert reasons(reply) == ["DIGEST_MISMATCH"] * 3 and {r.stage_index for r in reply.results} == {1}
            assert all(h[1] is False for h in last.held(*[r.rid for r in reqs]))   # nothing reached its KV
        assert stream.end() == grpc.StatusCode.OK
        assert first.stats().faults_injected[kind] == 3
        assert last.stats().rejections["DIGEST_MISMATCH"] == before + 9


def test_crossed_request_ids_show_in_the_echo(start_stage, last, kit):
    """Prefill slots under each other's ids are self-consistent, so the next stage cannot tell: the echoed
    stamps carry the other request's hashes, which is what the coordinator's echo check rejects."""
    first = chain(start_stage, last, "cross_ids=1,seed=4")
    stream = first.stream()
    reqs, frame = prompts_frame(stream, kit, "x")
    sent = {s.stamp.request_id: s.stamp.context_hash for s in frame.slots}
    reply = stream.ask(frame)
    mismatched = [r.stamp.request_id for r in reply.results if r.stamp.context_hash != sent[r.stamp.request_id]]
    assert len(mismatched) == 2
    stream.end()
    assert first.stats().faults_injected["cross_ids"] == 1


def test_duplicates_and_delays_between_stages(start_stage, last, kit):
    first = chain(start_stage, last, "duplicate=1,delay=1,delay_ms=150")
    stream = first.stream()
    before = last.stats().rejections.get("BAD_SEQUENCE", 0)
    for k in range(3):
        reqs, frame = prompts_frame(stream, kit, f"dup{k}")
        t0 = time.monotonic()
        reply = stream.ask(frame)                          # exactly one reply per frame, and it is good
        assert reasons(reply) == ["ok"] * 3 and time.monotonic() - t0 >= 0.15
    assert stream.end() == grpc.StatusCode.OK and stream.leftover == []
    st = first.stats()
    assert st.faults_injected["duplicate"] == 3 and st.faults_injected["delay"] == 3
    assert last.stats().rejections["BAD_SEQUENCE"] == before + 9   # each copy refused as out of sequence


def test_reorder_between_stages(start_stage, last, kit):
    first = chain(start_stage, last, "reorder=1,hold_ms=1500")
    stream = first.stream()
    (_, fa), (_, fb) = prompts_frame(stream, kit, "ra", 1), prompts_frame(stream, kit, "rb", 1)
    stream.send(fa)
    stream.send(fb)                                        # a is held, then goes out after b
    replies = {r.stream_seq: reasons(r) for r in (stream.recv(), stream.recv())}
    assert replies == {1: ["BAD_SEQUENCE"], 2: ["BAD_SEQUENCE"]}
    rc, fc = prompts_frame(stream, kit, "rc", 1)           # held, no successor: flushed late, in order
    t0 = time.monotonic()
    assert reasons(stream.ask(fc)) == ["ok"] and time.monotonic() - t0 >= 1.5
    stream.end()
    assert first.stats().faults_injected["reorder"] == 2


def test_dropped_frames_are_never_answered(start_stage, last, kit):
    first = chain(start_stage, last, "drop=1")
    stream = first.stream()
    for k in range(2):
        stream.send(prompts_frame(stream, kit, f"drop{k}", 1)[1])
    kit.wait_for(lambda: first.stats().faults_injected["drop"] == 2, what="both frames dropped")
    assert stream.end() == grpc.StatusCode.OK and stream.leftover == []


def test_reply_faults_on_the_last_stage(start_stage, kit, expected):
    crossed = start_stage("--faults", "cross_ids=1,seed=6")
    crossed.handshake()
    stream = crossed.stream()
    reqs, frame = prompts_frame(stream, kit, "rc")
    sent = {s.stamp.request_id: s.stamp.context_hash for s in frame.slots}
    reply = stream.ask(frame)
    assert sum(r.stamp.context_hash != sent[r.stamp.request_id] for r in reply.results) == 2
    stream.end()

    corrupt = start_stage("--faults", "corrupt=1,seed=6")
    corrupt.handshake()
    stream = corrupt.stream()
    reqs, frame = prompts_frame(stream, kit, "rt")
    reply = stream.ask(frame)
    by_id = {r.stamp.request_id: r for r in reply.results}
    bad = [i for i, r in enumerate(reqs) if by_id[r.rid].token_id != expected[i][0]]
    assert len(bad) == 1                                   # the echo is intact: only the token binding shows it
    for i, r in enumerate(reqs):
        res = by_id[r.rid]
        bound = res.token_hash == r.token_mac(res.token_id)
        assert bound == (i not in bad)
    stream.end()
    assert corrupt.stats().faults_injected["corrupt"] == 1


def test_crash_from_the_environment(start_stage, kit):
    s = start_stage(env={"TETHER_FAULTS": "crash=1"})
    assert "fault injection ON: crash=1" in s.log()
    s.handshake()
    stream = s.stream()
    stream.send(stream.frame([kit.Req("boom", [1, 2]).slot()]))
    with pytest.raises(grpc.RpcError) as e:
        stream.recv()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert s.proc.wait(timeout=30) == 137
    stream.cancel()
