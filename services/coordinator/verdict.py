"""What a slot's result, or the stages' answers to a SyncState, mean for a request: the coordinator's
recovery policy as pure functions (docs/PROTOCOL.md "Recovery"); the driver carries the verdicts out."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.coordinator.scheduler import Request
from tether.v1 import stage_pb2

RejectReason = stage_pb2.RejectReason
ReplyCheck = Callable[[Request, stage_pb2.SlotResult], bool]


class Verdict(enum.Enum):
    CONFIRM = "confirm"           # a prefill chunk landed on every stage; the next chunk follows
    APPEND = "append"             # a token, proven: append it
    PREFIX_MISS = "prefix miss"   # a stage could not confirm the cached prefix: replay cold
    REBUILD = "rebuild"           # anything else: replay the whole context under a new epoch


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str = ""    # the RejectReason name (or the coordinator's own: FRAME_LOST, ECHO_MISMATCH, ...)
    detail: str = ""


def reason_name(reason: int) -> str:
    """A RejectReason's name; a value this build does not know (a newer or hostile peer) still gets one."""
    try:
        return RejectReason.Name(reason)
    except ValueError:
        return f"UNKNOWN_REASON_{reason}"


def _rebuild(reason: str, detail: str) -> Judgement:
    return Judgement(Verdict.REBUILD, reason, detail)


def judge(req: Request, res: stage_pb2.SlotResult | None, echo_ok: ReplyCheck, token_ok: ReplyCheck) -> Judgement:
    """The verdict on the result of `req`'s frame in flight: a token is appended only if the echo is exactly
    what was sent and the keyed token hash proves the token (`echo_ok`, `token_ok`)."""
    if res is None:
        return _rebuild("FRAME_LOST", "no result for the slot")
    if not echo_ok(req, res):
        return _rebuild("ECHO_MISMATCH", "echoed stamp differs from the stamp sent")
    if not res.ok:
        detail = f"stage {res.stage_index}: {res.detail}"
        if res.reason == RejectReason.PREFIX_MISS and req.cached:
            return Judgement(Verdict.PREFIX_MISS, "PREFIX_MISS", detail)
        return _rebuild(reason_name(res.reason), detail)
    if not req.samples:
        if res.has_token:
            return _rebuild("ECHO_MISMATCH", "a token came back for a prefill chunk")
        return Judgement(Verdict.CONFIRM)
    if not res.has_token:
        return _rebuild("ECHO_MISMATCH", "last stage returned no token")
    if not token_ok(req, res):
        return _rebuild("TOKEN_HASH_MISMATCH", "the token does not extend the chain it was sampled from")
    return Judgement(Verdict.APPEND)


def held_everywhere(req: Request, states: Sequence[stage_pb2.HeldState | None]) -> bool:
    """Whether every stage holds exactly what the coordinator confirmed for `req` (so it may resume)."""
    return all(s is not None and s.held and s.epoch == req.epoch and s.length == req.fed
               and s.context_hash == req.fed_hash.value for s in states)


def describe_held(states: Sequence[stage_pb2.HeldState | None]) -> str:
    return ", ".join(f"stage {i}: " + ("nothing" if s is None or not s.held else f"epoch {s.epoch} length {s.length}")
                     for i, s in enumerate(states))
