"""The coordinator's recovery policy (services/coordinator/verdict.py), without a pipeline: what each slot
result means for its request, and when a synced request may resume."""

from __future__ import annotations

import pytest

from services.coordinator.scheduler import Request
from services.coordinator.verdict import Verdict, describe_held, held_everywhere, judge, reason_name
from tether.v1 import stage_pb2

RejectReason = stage_pb2.RejectReason


def yes(req, res) -> bool:
    return True


def no(req, res) -> bool:
    return False


def request(kit, chunk: int | None = None, cached: int = 0) -> Request:
    req = kit.request("r1", max_tokens=4)   # a two-token prompt
    req.sent, req.cached = req.stamp(chunk), cached
    return req


def result(req: Request, ok: bool = True, token: int | None = 7, reason: int = 0) -> stage_pb2.SlotResult:
    res = stage_pb2.SlotResult(stamp=req.sent, ok=ok, reason=reason, detail="d", stage_index=1)
    if token is not None:
        res.has_token, res.token_id = True, token
    return res


def test_a_proven_token_is_appended_and_nothing_else_is(kit):
    req = request(kit)
    assert judge(req, result(req), yes, yes).verdict is Verdict.APPEND
    j = judge(req, result(req), yes, no)
    assert (j.verdict, j.reason) == (Verdict.REBUILD, "TOKEN_HASH_MISMATCH")
    j = judge(req, result(req), no, yes)
    assert (j.verdict, j.reason) == (Verdict.REBUILD, "ECHO_MISMATCH")
    j = judge(req, result(req, token=None), yes, yes)
    assert (j.verdict, j.reason) == (Verdict.REBUILD, "ECHO_MISMATCH")
    j = judge(req, None, yes, yes)
    assert (j.verdict, j.reason) == (Verdict.REBUILD, "FRAME_LOST")


def test_a_prefill_chunk_confirms_without_a_token_and_rebuilds_with_one(kit):
    req = request(kit, chunk=1)
    assert not req.samples
    assert judge(req, result(req, token=None), yes, no).verdict is Verdict.CONFIRM   # no token, nothing to prove
    j = judge(req, result(req), yes, yes)
    assert (j.verdict, j.reason) == (Verdict.REBUILD, "ECHO_MISMATCH")


@pytest.mark.parametrize("cached, verdict", [(64, Verdict.PREFIX_MISS), (0, Verdict.REBUILD)])
def test_a_prefix_miss_replays_cold_only_when_a_prefix_was_sent(kit, cached, verdict):
    req = request(kit, cached=cached)
    j = judge(req, result(req, ok=False, token=None, reason=RejectReason.PREFIX_MISS), yes, yes)
    assert (j.verdict, j.reason, j.detail) == (verdict, "PREFIX_MISS", "stage 1: d")


def test_a_rejection_rebuilds_under_its_reason_even_one_this_build_does_not_know(kit):
    req = request(kit)
    j = judge(req, result(req, ok=False, token=None, reason=RejectReason.STALE_EPOCH), yes, yes)
    assert (j.verdict, j.reason) == (Verdict.REBUILD, "STALE_EPOCH")
    assert judge(req, result(req, ok=False, token=None, reason=999), yes, yes).reason == "UNKNOWN_REASON_999"
    assert reason_name(RejectReason.NO_CAPACITY) == "NO_CAPACITY"


def test_a_synced_request_resumes_only_where_every_stage_holds_what_was_confirmed(kit):
    req = request(kit)
    req.confirm()
    held = stage_pb2.HeldState(held=True, epoch=req.epoch, length=req.fed, context_hash=req.fed_hash.value)
    assert held_everywhere(req, [held, held])
    for wrong in (stage_pb2.HeldState(held=True, epoch=req.epoch + 1, length=req.fed, context_hash=held.context_hash),
                  stage_pb2.HeldState(held=True, epoch=req.epoch, length=req.fed - 1, context_hash=held.context_hash),
                  stage_pb2.HeldState(held=True, epoch=req.epoch, length=req.fed, context_hash=held.context_hash ^ 1),
                  stage_pb2.HeldState(held=False), None):
        assert not held_everywhere(req, [held, wrong])
    assert describe_held([held, None]) == f"stage 0: epoch {req.epoch} length {req.fed}, stage 1: nothing"
