"""Coordinator.Session, the stream admission sends every request over: per request the same tokens, statuses,
deadline and cancellation as Submit, however the requests share its messages."""

from __future__ import annotations

import threading
import time

import grpc

from tether.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc


def _submit(rid: str, prompt: list[int], max_tokens: int = 6, timeout_s: float = 0.0) -> coordinator_pb2.SubmitRequest:
    return coordinator_pb2.SubmitRequest(request_id=rid, prompt_token_ids=prompt, timeout_s=timeout_s,
                                         sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _session(stub, messages: list[coordinator_pb2.SessionMessage], ends: int) -> dict[str, list]:
    """Send the messages, then read events until `ends` requests have ended (the stream stays open, as admission
    keeps it)."""
    by_id: dict[str, list] = {}
    done = 0
    stop = threading.Event()
    call = stub.Session(_keep_open(messages, stop), timeout=60)
    try:
        for batch in call:
            for ev in batch.events:
                by_id.setdefault(ev.request_id, []).append(ev)
                if ev.finish_reason or ev.status_code:
                    done += 1
            if done >= ends:
                break
    finally:
        stop.set()
        call.cancel()
    return by_id


def _keep_open(messages, stop: threading.Event):
    yield from messages
    stop.wait(60)   # the stream stays open while events come, as admission keeps it


def test_session_requests_match_submit_token_for_token(cluster):
    prompts = {"s1": [5, 6, 7, 8], "s2": [9, 10, 11], "s3": [5, 6, 7, 8]}
    with grpc.insecure_channel(cluster.service("coordinator").address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        alone = {rid: [(e.index, e.token_id, e.text, e.context_hash) for e in
                       stub.Submit(_submit(f"alone-{rid}", p), timeout=60)] for rid, p in prompts.items()}
        msgs = [coordinator_pb2.SessionMessage(submit=[_submit(r, p) for r, p in list(prompts.items())[:2]]),
                coordinator_pb2.SessionMessage(submit=[_submit("s3", prompts["s3"])])]
        got = _session(stub, msgs, ends=3)
    for rid in prompts:
        events = got[rid]
        assert [e.index for e in events] == list(range(6)) and events[-1].finish_reason
        assert all(e.status_code == 0 for e in events)
        # the token hash binds the request id, the context hash does not: same prompt, same chain
        assert [(e.index, e.token_id, e.text, e.context_hash) for e in events] == alone[rid]


def test_session_statuses_deadlines_and_cancels_are_per_request(cluster):
    with grpc.insecure_channel(cluster.service("coordinator").address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        msgs = [coordinator_pb2.SessionMessage(submit=[
            _submit("ok", [5, 6, 7]),
            _submit("bad", []),                                         # INVALID_ARGUMENT
            _submit("late", [5, 6, 7], max_tokens=200, timeout_s=0.001),  # past its deadline at once
            _submit("gone", [5, 6, 7], max_tokens=200),
        ], cancel=["gone"])]                                            # cancelled in the message that starts it
        got = _session(stub, msgs, ends=3)
        assert got["ok"][-1].finish_reason and len(got["ok"]) == 6
        assert got["bad"][-1].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "prompt_token_ids is empty" in got["bad"][-1].status_message
        assert got["late"][-1].status_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert "gone" not in got
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:   # nothing left running once the stream is gone
            stats = stub.Stats(coordinator_pb2.StatsRequest(), timeout=5)
            if stats.running == 0 and stats.waiting == 0:
                break
            time.sleep(0.2)
        assert stats.running == 0 and stats.waiting == 0
