"""What a stage holds per request, and the per-slot checks that guard it (DESIGN.md checks 1, 2 and 4).

Pure logic: no gRPC, no model. A slot is checked before anything touches its KV; a rejected slot leaves
the stage exactly as it was.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tether.kv.cache import KVCache
from tether.kv.paged import PagedKV
from tether.protocol.hashing import ContextHasher
from tether.v1 import stage_pb2

R = stage_pb2.RejectReason


class Rejected(Exception):
    """A slot failed a check; `reason` is a stage_pb2.RejectReason."""

    def __init__(self, reason: int, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class RequestState:
    request_id: str
    epoch: int
    hasher: ContextHasher
    kv: KVCache | PagedKV
    kv_tag: int                        # context hash the KV buffers were last written for
    last_used: float = field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        return self.hasher.length


@dataclass
class Admitted:
    """A slot that passed every check: where its rows go, and the state to commit after the step."""

    state: RequestState
    position: int
    token_ids: list[int]
    context_hash: int
    fresh: bool                        # the state was created for this slot (drop it if the step fails)


class StageState:
    """All requests' state on one stage, keyed by request id."""

    def __init__(self, new_kv, max_context: int, checks: bool = True) -> None:
        self._new_kv = new_kv          # callable(owner: str) -> KVCache | PagedKV
        self.max_context = max_context
        # False only under --unsafe-disable-stamp-checks: an experiment that reproduces what a pipeline
        # without stamps does (trust the frame's position, run on whatever state is there). Never a default.
        self.checks = checks
        self.requests: dict[str, RequestState] = {}

    def check(self, slot: stage_pb2.Slot) -> Admitted:
        """Run checks 1, 2 and 4 for one slot; raise Rejected, or return what to run and commit."""
        st = slot.stamp
        rid, n = st.request_id, len(st.token_ids)
        if not rid or n == 0:
            raise Rejected(R.BAD_FRAME, "slot without request id or tokens")
        if st.position + n > self.max_context:
            raise Rejected(R.BAD_FRAME, f"position {st.position}+{n} exceeds the context window {self.max_context}")
        if not self.checks:
            return self._admit_unchecked(slot)
        held = self.requests.get(rid)
        fresh = False
        if held is not None and st.epoch < held.epoch:
            raise Rejected(R.STALE_EPOCH, f"epoch {st.epoch} is older than held epoch {held.epoch}")
        if held is not None and st.epoch > held.epoch:
            if st.position != 0:
                raise Rejected(R.STALE_EPOCH, f"new epoch {st.epoch} must start at position 0, not {st.position}")
            held = None                # a rebuilt request replaces its old state (committed only on success)
        if held is None:
            if st.position != 0:
                raise Rejected(R.UNKNOWN_REQUEST, f"no state for {rid} but frame starts at position {st.position}")
            hasher = ContextHasher(slot.hash_seed)
            held = RequestState(rid, st.epoch, hasher, self._new_kv(rid), hasher.value)
            fresh = True
        elif st.position != held.length:
            raise Rejected(R.POSITION_GAP, f"frame starts at {st.position}, stage holds {held.length} tokens")
        if held.hasher.seed != slot.hash_seed or held.hasher.value != st.parent_hash:
            raise Rejected(R.STATE_MISMATCH, "parent hash differs from the context this stage holds")
        if held.hasher.peek(st.token_ids) != st.context_hash:
            raise Rejected(R.STATE_MISMATCH, "context hash does not match parent hash + token ids")
        if held.kv.owner != rid or held.kv_tag != held.hasher.value:
            raise Rejected(R.KV_TAG_MISMATCH, "KV buffers are tagged for another context")
        return Admitted(held, st.position, list(st.token_ids), st.context_hash, fresh)

    def _admit_unchecked(self, slot: stage_pb2.Slot) -> Admitted:
        """No checks 1, 2, 4 (experiment only): position 0 starts over, anything else runs on whatever state
        the stage holds for that id, fresh (zero) state when it holds none. Wrong state gives wrong tokens:
        that is what the experiment shows."""
        st = slot.stamp
        held = self.requests.get(st.request_id)
        fresh = held is None or st.position == 0
        if fresh:
            hasher = ContextHasher(slot.hash_seed)
            held = RequestState(st.request_id, st.epoch, hasher, self._new_kv(st.request_id), hasher.value)
        return Admitted(held, st.position, list(st.token_ids), st.context_hash, fresh)

    def commit(self, a: Admitted) -> None:
        """The step ran: the KV now holds the slot's tokens; advance the chain and tag."""
        old = self.requests.get(a.state.request_id)
        if old is not None and old is not a.state:
            old.kv.release()
        a.state.hasher.extend(a.token_ids)
        # The KV holds rows 0..position+n now. With the checks on this equals the chain's length; without
        # them (experiment) the two may differ, and the KV length is what the next step may read.
        a.state.kv.length = a.position + len(a.token_ids)
        a.state.kv_tag = a.state.hasher.value
        a.state.last_used = time.monotonic()
        self.requests[a.state.request_id] = a.state

    def abandon(self, a: Admitted) -> None:
        """The step failed after admission: free a state that was never committed."""
        if a.fresh and self.requests.get(a.state.request_id) is not a.state:
            a.state.kv.release()

    def release(self, request_ids) -> int:
        n = 0
        for rid in request_ids:
            st = self.requests.pop(rid, None)
            if st is not None:
                st.kv.release()
                n += 1
        return n

    def expire(self, lease_s: float, now: float | None = None) -> list[str]:
        """Free state idle longer than the lease (a lost Release or a dead coordinator leaks nothing)."""
        now = time.monotonic() if now is None else now
        stale = [rid for rid, st in self.requests.items() if now - st.last_used > lease_s]
        self.release(stale)
        return stale

    def held(self, request_id: str) -> stage_pb2.HeldState:
        st = self.requests.get(request_id)
        if st is None:
            return stage_pb2.HeldState(request_id=request_id, held=False)
        return stage_pb2.HeldState(request_id=request_id, held=True, epoch=st.epoch, length=st.length,
                                   context_hash=st.hasher.value)
