"""What a stage holds per request, and the checks that guard it (docs/PROTOCOL.md; where each is enforced:
docs/ARCHITECTURE.md), including the prefix cache: a new state may start from cached blocks, each confirmed
by its token ids.

Every check is one row of `CHECKS`, in the order a frame meets them: its level (the relay walks the `stream`
rows; the worker the `frame` rows, then per slot the `slot` and `state` rows), the RejectReason it answers
with, its predicate, and whether the experiment-only UncheckedStageState (services/stage_worker/unchecked.py)
skips it. A new reject reason is the proto's enum value plus one row here (and its row in docs/PROTOCOL.md's
table, which tests/services/stage_worker/test_check_table.py holds to this one).

Pure logic: no gRPC, no model. A slot is checked before anything touches its KV; a rejected slot leaves
the stage exactly as it was.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from tether.kv.blocks import (NO_HIT, BlockPool, NoCapacity, PrefixHit, block_keys, extend_by_blocks, inner_keys,
                              parent_serial)
from tether.kv.paged import PagedKV
from tether.protocol import tensors
from tether.protocol.hashing import ContextHasher, context_hash, sampling_digest
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

RejectReason = stage_pb2.RejectReason


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
    kv: PagedKV
    kv_tag: int                        # context hash the KV buffers were last written for
    last_used: float = field(default_factory=time.monotonic)
    tokens: array = field(default_factory=lambda: array("I"))   # the context, for the prefix cache's checks
    block_ends: list[int] = field(default_factory=list)         # the chain's value at each full block's end

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
    cached: int = 0                    # leading token_ids taken from the prefix cache: not computed

    @property
    def start(self) -> int:
        """The first position this step computes."""
        return self.position + self.cached

    @property
    def rows(self) -> int:
        """Rows this step computes (and the frame carries activations for)."""
        return len(self.token_ids) - self.cached


@dataclass
class CachedBlock:
    """What a stage keeps with a block in its prefix cache: a hit must match all of it, never the key alone."""

    seed: int                          # the chain's salt: model and tenant namespace
    tokens: tuple[int, ...]            # the block's token ids
    parent: int                        # serial of the previous block's registration (0 for the first block)


@dataclass
class FrameView:
    """A frame as its checks read it, with what the walker knows: the relay its stream's last sequence number
    and the handshake's epoch; the worker the stamp key, its limits and its model's shape."""

    frame: stage_pb2.Frame
    last_seq: int = 0
    pipeline_epoch: int | None = 0
    key: StampKey | None = None
    max_slots: int = 0
    max_rows: int = 0
    has_embedding: bool = False
    has_head: bool = False
    vocab: int = 0
    hidden: int = 0
    dtype: str = ""
    activations: torch.Tensor | None = None           # the decoded rows, left by the tensor check
    seen: set[str] = field(default_factory=set)       # request ids met so far in the frame (the slot checks)

    @cached_property
    def rows(self) -> int:
        """Activation rows the slots claim (after the cached-prefix check: never negative)."""
        return sum(len(s.stamp.token_ids) - s.cached_prefix for s in self.frame.slots)


@dataclass
class SlotView:
    """A slot as its checks read it: what the stage holds for its request, and what the checks found."""

    slot: stage_pb2.Slot
    frame: FrameView                    # the frame's view (the slot rows read it; the state rows never)
    held: RequestState | None           # what the stage holds for the request, any epoch
    live: RequestState | None           # ... if the slot extends it (same epoch): None starts a new state
    replaces: RequestState | None       # ... if the slot starts a newer epoch over it
    hit: PrefixHit = NO_HIT             # where the cached prefix is, left by the prefix check

    @classmethod
    def of(cls, slot: stage_pb2.Slot, requests: dict[str, RequestState], frame: FrameView) -> "SlotView":
        held = requests.get(slot.stamp.request_id)
        if held is None or slot.stamp.epoch < held.epoch:
            return cls(slot, frame, held, held, None)
        if slot.stamp.epoch > held.epoch:
            return cls(slot, frame, held, None, held)
        return cls(slot, frame, held, held, None)

    @cached_property
    def base(self) -> ContextHasher:
        """The chain the slot extends: the live state's, or a new one of the slot's seed."""
        return self.live.hasher if self.live is not None else ContextHasher(self.slot.hash_seed)


# --- the predicates: each returns the refusal's detail, or None when the check passes --------------------------
def _in_sequence(state, v: FrameView) -> str | None:
    if v.frame.stream_seq != v.last_seq + 1:
        return f"stream_seq {v.frame.stream_seq} is not the next one"
    return None


def _this_pipeline_epoch(state, v: FrameView) -> str | None:
    return None if v.frame.pipeline_epoch == v.pipeline_epoch else "frame of another pipeline epoch"


def _rows_defined(state, v: FrameView) -> str | None:
    # the one cached-prefix shape check: a slot whose rows would be ill-defined makes the whole frame untrusted
    for s in v.frame.slots:
        c = s.cached_prefix
        if c and (c >= len(s.stamp.token_ids) or s.stamp.position != 0):
            return f"slot with cached_prefix {c} of {len(s.stamp.token_ids)} tokens at position {s.stamp.position}"
    return None


def _limits_detail(v: FrameView) -> str:
    return (f"frame of {len(v.frame.slots)} slots and {v.rows} rows; this stage takes at most {v.max_slots} slots "
            f"and {v.max_rows} rows (advertised at handshake)")


def _slots_within_limit(state, v: FrameView) -> str | None:
    return _limits_detail(v) if len(v.frame.slots) > v.max_slots else None


def _rows_within_limit(state, v: FrameView) -> str | None:
    return _limits_detail(v) if v.rows > v.max_rows else None


def _keyed(state, v: FrameView) -> str | None:
    return None if v.key is not None else "no stamp key: this stage has not been handshaken"


def _intact(state, v: FrameView) -> str | None:
    """The payload digest binds these bytes to these slots' claims, in order (StampKey.frame_digest)."""
    if v.key is not None and v.key.frame_digest(v.frame.activations.data, v.frame.slots) == v.frame.payload_digest:
        return None
    return "payload digest does not bind these bytes to these slots"


def _sound_tensor(state, v: FrameView) -> str | None:
    if v.has_embedding or not v.frame.slots:      # the first stage embeds ids; a keep-alive carries no rows
        return None
    try:
        v.activations = tensors.decode(v.frame.activations, rows=v.rows, width=v.hidden, dtype=v.dtype)
    except tensors.BadTensor as e:
        return f"activations: {e}"
    return None


def _ids_not_rows(state, v: FrameView) -> str | None:
    if v.has_embedding and v.frame.HasField("activations") and v.frame.activations.data:
        return "the first stage takes token ids, not activations"
    return None


def _authentic(state, v: SlotView) -> str | None:
    # first, before anything reads the claim: only the coordinator holds this epoch's key
    key = v.frame.key
    return None if key is not None and key.verify(v.slot) else "the stamp's MAC is not the pipeline key's over this slot"


def _once(state, v: SlotView) -> str | None:
    rid = v.slot.stamp.request_id
    if rid in v.frame.seen:
        return "request appears twice in one frame"
    v.frame.seen.add(rid)
    return None


def _in_vocabulary(state, v: SlotView) -> str | None:
    ids = v.slot.stamp.token_ids
    if v.frame.has_embedding and ids and max(ids) >= v.frame.vocab:
        # hashes can be consistent over any ids: this stage must not index its embedding with them
        return f"token id {max(ids)} outside the vocabulary of {v.frame.vocab}"
    return None


def _sampling_matches(state, v: SlotView) -> str | None:
    """The last stage samples with the parameters the stamp's (MAC-bound) digest names."""
    if v.frame.has_head and v.slot.sample and sampling_digest(v.slot.sampling) != v.slot.stamp.sampling_digest:
        return "the slot's sampling parameters do not match its stamp"
    return None


def _named(state, v: SlotView) -> str | None:
    st = v.slot.stamp
    return None if st.request_id and st.token_ids else "slot without request id or tokens"


def _in_window(state, v: SlotView) -> str | None:
    st = v.slot.stamp
    if st.position + len(st.token_ids) > state.max_context:
        return f"position {st.position}+{len(st.token_ids)} exceeds the context window {state.max_context}"
    return None


def _not_older(state, v: SlotView) -> str | None:
    e, held = v.slot.stamp.epoch, v.held
    return f"epoch {e} is older than held epoch {held.epoch}" if held is not None and e < held.epoch else None


def _new_epoch_at_zero(state, v: SlotView) -> str | None:
    st = v.slot.stamp
    if v.replaces is not None and st.position != 0:
        return f"new epoch {st.epoch} must start at position 0, not {st.position}"
    return None


def _known(state, v: SlotView) -> str | None:
    st = v.slot.stamp
    if v.live is None and st.position != 0:
        return f"no state for {st.request_id} but frame starts at position {st.position}"
    return None


def _no_gap(state, v: SlotView) -> str | None:
    st = v.slot.stamp
    if v.live is not None and st.position != v.live.length:
        return f"frame starts at {st.position}, stage holds {v.live.length} tokens"
    return None


def _extends_held_chain(state, v: SlotView) -> str | None:
    if v.base.seed != v.slot.hash_seed or v.base.value != v.slot.stamp.parent_hash:
        return "parent hash differs from the context this stage holds"
    return None


def _reaches_context(state, v: SlotView) -> str | None:
    if v.base.peek(v.slot.stamp.token_ids) != v.slot.stamp.context_hash:
        return "context hash does not match parent hash + token ids"
    return None


def _kv_tagged(state, v: SlotView) -> str | None:
    live = v.live
    if live is not None and (live.kv.owner != v.slot.stamp.request_id or live.kv_tag != live.hasher.value):
        return "KV buffers are tagged for another context"
    return None


def _prefix_starts_state(state, v: SlotView) -> str | None:
    return "a cached prefix can only start a new state" if v.slot.cached_prefix and v.live is not None else None


def _prefix_cached(state, v: SlotView) -> str | None:
    if not v.slot.cached_prefix:
        return None
    try:
        v.hit = state._cached_blocks(v.slot.hash_seed, list(v.slot.stamp.token_ids), v.slot.cached_prefix)
    except Rejected as e:
        return e.detail
    return None


@dataclass(frozen=True)
class Check:
    """One row of the stage's checks: a failed predicate rejects with `reason` (every slot of the frame at
    the `stream` and `frame` levels, the one slot at `slot` and `state`)."""

    level: str                                     # stream (the relay) | frame | slot (the worker) | state
    reason: int                                    # a RejectReason
    test: Callable[..., str | None]                # (StageState, FrameView | SlotView) -> detail, or None
    unsafe_skips: bool                             # UncheckedStageState skips it (--unsafe-disable-stamp-checks)
    refusal: str = ""                              # also counted in Stats.refusals under this name

    @property
    def name(self) -> str:
        return self.test.__name__.lstrip("_")


LEVELS = ("stream", "frame", "slot", "state")
# In the order a frame meets them. docs/PROTOCOL.md "What a stage checks before it touches any KV" lists the
# same rows (held to this table by tests/services/stage_worker/test_check_table.py).
CHECKS: tuple[Check, ...] = (
    Check("stream", RejectReason.BAD_SEQUENCE, _in_sequence, True),
    Check("stream", RejectReason.STALE_EPOCH, _this_pipeline_epoch, False),
    Check("frame", RejectReason.BAD_FRAME, _rows_defined, False),
    Check("frame", RejectReason.BAD_FRAME, _slots_within_limit, False, "FRAME_SLOTS"),
    Check("frame", RejectReason.BAD_FRAME, _rows_within_limit, False, "FRAME_ROWS"),
    Check("frame", RejectReason.STAMP_FORGED, _keyed, False),
    Check("frame", RejectReason.DIGEST_MISMATCH, _intact, True),
    Check("frame", RejectReason.BAD_TENSOR, _sound_tensor, False),
    Check("frame", RejectReason.BAD_FRAME, _ids_not_rows, False),
    Check("slot", RejectReason.STAMP_FORGED, _authentic, True),
    Check("slot", RejectReason.BAD_FRAME, _once, False),
    Check("slot", RejectReason.BAD_FRAME, _in_vocabulary, False),
    Check("slot", RejectReason.BAD_FRAME, _sampling_matches, True),
    Check("state", RejectReason.BAD_FRAME, _named, False),
    Check("state", RejectReason.BAD_FRAME, _in_window, False),
    Check("state", RejectReason.STALE_EPOCH, _not_older, True),
    Check("state", RejectReason.STALE_EPOCH, _new_epoch_at_zero, True),
    Check("state", RejectReason.UNKNOWN_REQUEST, _known, True),
    Check("state", RejectReason.POSITION_GAP, _no_gap, True),
    Check("state", RejectReason.STATE_MISMATCH, _extends_held_chain, True),
    Check("state", RejectReason.STATE_MISMATCH, _reaches_context, True),
    Check("state", RejectReason.KV_TAG_MISMATCH, _kv_tagged, True),
    Check("state", RejectReason.BAD_FRAME, _prefix_starts_state, True),
    Check("state", RejectReason.PREFIX_MISS, _prefix_cached, True),
)


_NO_FRAME = FrameView(stage_pb2.Frame())   # what StageState.check's state rows get: they read no frame


class StageState:
    """All requests' state on one stage, keyed by request id, and the checks every frame and slot pass."""

    stamp_checks = True   # False only in the experiment-only UncheckedStageState: the rows it skips are skipped

    def __init__(self, new_kv, max_context: int, pool: BlockPool | None = None, block: int = 0) -> None:
        self._new_kv = new_kv          # callable(owner: str) -> PagedKV
        self.max_context = max_context
        self.requests: dict[str, RequestState] = {}
        self.pool = pool if block else None   # the prefix cache: the arena's block pool
        self.block = block
        self.checks = {level: tuple(c for c in CHECKS if c.level == level and (self.stamp_checks or not c.unsafe_skips))
                       for level in LEVELS}

    def refusal(self, level: str, view: FrameView | SlotView) -> tuple[Check, str] | None:
        """The first check of `level` that `view` fails, with its detail; None when it passes them all."""
        for c in self.checks[level]:
            detail = c.test(self, view)
            if detail is not None:
                return c, detail
        return None

    def token_digest(self, slot: stage_pb2.Slot) -> int:
        """The sampling digest a sampled token's hash binds: the stamp's (`_sampling_matches` held on admission)."""
        return slot.stamp.sampling_digest

    # --- one slot against the state this stage holds ----------------------------------------------------------
    def check(self, slot: stage_pb2.Slot) -> Admitted:
        """The `state` checks of a slot (well-formed, and extending the state held for its request); raise
        Rejected, or return what to run and commit (`_admit`)."""
        view = SlotView.of(slot, self.requests, _NO_FRAME)
        found = self.refusal("state", view)
        if found is not None:
            raise Rejected(found[0].reason, found[1])
        return self._admit(view)

    def _admit(self, v: SlotView) -> Admitted:
        """The slot passed: the state it runs on (a new one unless it extends the live one; a replaced epoch's
        state freed first, so the replay never needs room the old one holds: its full blocks stay cached)."""
        st, rid = v.slot.stamp, v.slot.stamp.request_id
        held, fresh = v.live, False
        if held is None:
            hasher = ContextHasher(v.slot.hash_seed)
            held = RequestState(rid, st.epoch, hasher, self._new_kv(rid), hasher.value)
            fresh = True
        if v.replaces is not None:
            self.release([rid])
        if v.hit:
            held.kv.attach(v.hit.blocks, v.hit.source, v.hit.count)
        return Admitted(held, st.position, list(st.token_ids), st.context_hash, fresh, v.slot.cached_prefix)

    def _cached_blocks(self, seed: int, ids: list[int], cached: int) -> PrefixHit:
        """Where the first `cached` of `ids` are cached: whole blocks, then (unless `cached` ends on a block
        boundary) the first positions of one more block, found by the chain's value at `cached`. Every block
        is confirmed (seed, token ids, and the chain of registrations); PREFIX_MISS unless all are there."""
        pool, block = self.pool, self.block
        if pool is None:
            raise Rejected(RejectReason.PREFIX_MISS, "this stage keeps no prefix cache")
        n, part = divmod(cached, block)

        def serves(info: CachedBlock | None, parent: int, start: int, end: int) -> bool:
            """Never the key alone: the block's seed, its parent registration and its first end - start token
            ids must be the slot's."""
            return (info is not None and info.seed == seed and info.parent == parent
                    and info.tokens[:end - start] == tuple(ids[start:end]))

        found = pool.match(block_keys(seed, ids[:n * block], block),
                           lambda i, b, entry, prev: serves(entry.info, parent_serial(prev), i * block, (i + 1) * block))
        source = None
        if len(found) == n and part:
            b = pool.inner.get(context_hash(seed, ids[:cached]))
            if b is not None and serves(pool.entries[b].info, parent_serial(pool.entry(found[-1]) if found else None),
                                        n * block, cached):
                source = b
        confirmed = len(found) == n and (source is not None or not part)   # every position claimed
        pool.count_query(n, len(found), cached if confirmed else 0)
        if len(found) < n:
            raise Rejected(RejectReason.PREFIX_MISS, f"{len(found)} of the {n} prefix blocks asked for are cached here")
        if part and source is None:
            raise Rejected(RejectReason.PREFIX_MISS, f"no block here starts with the {part} tokens after the "
                                                     f"{n} whole blocks asked for")
        return PrefixHit(found, source, part if source is not None else 0)

    def reserve(self, a: Admitted) -> None:
        """Make room in the request's KV for the slot's rows; NO_CAPACITY (the stage as it was) if the pool cannot."""
        try:
            a.state.kv.ensure(a.position + len(a.token_ids))
        except NoCapacity as e:
            self.abandon(a)
            raise Rejected(RejectReason.NO_CAPACITY, str(e)) from None

    def commit(self, a: Admitted) -> None:
        """The step ran: the KV now holds the slot's tokens; advance the chain and tag, and offer the blocks
        it filled to the prefix cache."""
        old = self.requests.get(a.state.request_id)
        if old is not None and old is not a.state:
            old.kv.release()
        if self.pool is not None:
            self._extend_and_register(a.state, a.token_ids)
        else:
            a.state.hasher.extend(a.token_ids)
        # The KV holds rows 0..position+n now: the chain's length (without the checks, in UncheckedStageState,
        # the two may differ, and the KV length is what the next step may read).
        a.state.kv.length = a.position + len(a.token_ids)
        a.state.kv_tag = a.state.hasher.value
        a.state.last_used = time.monotonic()
        self.requests[a.state.request_id] = a.state

    def _extend_and_register(self, state: RequestState, ids: list[int]) -> None:
        """Extend the chain by `ids` block boundary by block boundary; register each block that became full
        under the chain's value at its end (salted by model and tenant), chained to the registration of the
        block before it. A block whose key another block already holds stays private."""
        block, pool, kv = self.block, self.pool, state.kv
        assert pool is not None   # called with the prefix cache on only
        first = state.hasher.length // block              # the block the first of `ids` falls in
        ends = extend_by_blocks(state.hasher, ids, block)
        state.tokens.extend(ids)
        for k, value in enumerate(ends):
            state.block_ends.append(value)
            i = first + k
            end = (i + 1) * block
            b = kv.blocks[i]
            if pool.entry(b) is not None:
                continue                       # attached from the cache: registered already
            prev = None
            if i > 0:
                prev = pool.entry(kv.blocks[i - 1])
                if prev is None:               # the block before is private: link to the cached twin, if any
                    twin = pool.lookup((state.hasher.seed, state.block_ends[i - 1]))
                    prev = pool.entry(twin) if twin is not None else None
                    if prev is None or prev.info.tokens != tuple(state.tokens[(i - 1) * block:i * block]):
                        continue
            key = (state.hasher.seed, value)
            if pool.lookup(key) is not None:
                continue                       # a twin holds the key: this block stays private
            info = CachedBlock(state.hasher.seed, tuple(state.tokens[i * block:end]), parent_serial(prev))
            pool.register(b, key, info, inner_keys(state.hasher.seed, state.tokens, i, block))

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
