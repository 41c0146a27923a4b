"""What a stage holds per request, and the checks that guard it (docs/PROTOCOL.md; where each is enforced:
docs/ARCHITECTURE.md), including the prefix cache: a new state may start from cached blocks, each confirmed
by its token ids.

Pure logic: no gRPC, no model. A slot is checked before anything touches its KV; a rejected slot leaves
the stage exactly as it was. These are the serving checks, always on; the one class without them,
experiment only, is services/stage_worker/unchecked.py.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

from tether.kv.blocks import BlockPool, NoCapacity, block_keys, extend_by_blocks
from tether.kv.paged import PagedKV
from tether.protocol.hashing import ContextHasher, sampling_digest
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


class StageState:
    """All requests' state on one stage, keyed by request id, and the checks every frame and slot pass."""

    stamp_checks = True   # what Stats reports; False only in the experiment-only UncheckedStageState

    def __init__(self, new_kv, max_context: int, pool: BlockPool | None = None, block: int = 0) -> None:
        self._new_kv = new_kv          # callable(owner: str) -> PagedKV
        self.max_context = max_context
        self.requests: dict[str, RequestState] = {}
        self.pool = pool if block else None   # the prefix cache: the arena's block pool
        self.block = block

    # --- what a frame claims, checked before any state is looked at ------------------------------------------
    def in_sequence(self, stream_seq: int, last_seq: int) -> bool:
        """The frame is the next one on its stream (else BAD_SEQUENCE)."""
        return stream_seq == last_seq + 1

    def intact(self, frame: stage_pb2.Frame, key: StampKey) -> bool:
        """The payload digest binds these activation bytes to these slots (else DIGEST_MISMATCH)."""
        return key.frame_digest(frame.activations.data, frame.slots) == frame.payload_digest

    def authentic(self, slot: stage_pb2.Slot, key: StampKey) -> bool:
        """The stamp's MAC is the pipeline key's over this slot (else STAMP_FORGED): only the coordinator holds
        this epoch's key."""
        return key.verify(slot)

    def sampling_matches(self, slot: stage_pb2.Slot) -> bool:
        """The slot's sampling parameters are the ones its stamp's digest names (else BAD_FRAME)."""
        return sampling_digest(slot.sampling) == slot.stamp.sampling_digest

    def token_digest(self, slot: stage_pb2.Slot) -> int:
        """The sampling digest a sampled token's hash binds: the stamp's (`sampling_matches` held on admission)."""
        return slot.stamp.sampling_digest

    # --- one slot against the state this stage holds ----------------------------------------------------------
    def check(self, slot: stage_pb2.Slot) -> Admitted:
        """A well-formed slot (BAD_FRAME) that extends the state held for its request (`_admit`); raise
        Rejected, or return what to run and commit."""
        self._well_formed(slot)
        return self._admit(slot)

    def _well_formed(self, slot: stage_pb2.Slot) -> None:
        st = slot.stamp
        rid, n = st.request_id, len(st.token_ids)
        if not rid or n == 0:
            raise Rejected(RejectReason.BAD_FRAME, "slot without request id or tokens")
        if st.position + n > self.max_context:
            raise Rejected(RejectReason.BAD_FRAME, f"position {st.position}+{n} exceeds the context window {self.max_context}")
        cached = slot.cached_prefix
        if cached and (st.position != 0 or cached >= n or not self.block or cached % self.block):
            raise Rejected(RejectReason.BAD_FRAME, f"cached_prefix {cached} must be a multiple of {self.block or 'the KV block'}"
                                        f" below the slot's {n} tokens, at position 0")

    def _admit(self, slot: stage_pb2.Slot) -> Admitted:
        """The slot's stamp against the state held: STALE_EPOCH, UNKNOWN_REQUEST, POSITION_GAP, STATE_MISMATCH,
        KV_TAG_MISMATCH, and for a cached prefix PREFIX_MISS."""
        st, cached = slot.stamp, slot.cached_prefix
        rid = st.request_id
        held = self.requests.get(rid)
        fresh = False
        if held is not None and st.epoch < held.epoch:
            raise Rejected(RejectReason.STALE_EPOCH, f"epoch {st.epoch} is older than held epoch {held.epoch}")
        replaces = None
        if held is not None and st.epoch > held.epoch:
            if st.position != 0:
                raise Rejected(RejectReason.STALE_EPOCH, f"new epoch {st.epoch} must start at position 0, not {st.position}")
            replaces, held = held, None   # a rebuilt request replaces its old state (freed once the slot passes)
        if held is None:
            if st.position != 0:
                raise Rejected(RejectReason.UNKNOWN_REQUEST, f"no state for {rid} but frame starts at position {st.position}")
            hasher = ContextHasher(slot.hash_seed)
            held = RequestState(rid, st.epoch, hasher, self._new_kv(rid), hasher.value)
            fresh = True
        elif st.position != held.length:
            raise Rejected(RejectReason.POSITION_GAP, f"frame starts at {st.position}, stage holds {held.length} tokens")
        if held.hasher.seed != slot.hash_seed or held.hasher.value != st.parent_hash:
            raise Rejected(RejectReason.STATE_MISMATCH, "parent hash differs from the context this stage holds")
        if held.hasher.peek(st.token_ids) != st.context_hash:
            raise Rejected(RejectReason.STATE_MISMATCH, "context hash does not match parent hash + token ids")
        if held.kv.owner != rid or held.kv_tag != held.hasher.value:
            raise Rejected(RejectReason.KV_TAG_MISMATCH, "KV buffers are tagged for another context")
        ids = list(st.token_ids)
        if cached and not fresh:
            raise Rejected(RejectReason.BAD_FRAME, "a cached prefix can only start a new state")
        blocks = self._cached_blocks(slot.hash_seed, ids, cached) if cached else []
        if replaces is not None:
            # The replay must not need room the old epoch's blocks hold (the coordinator's ledger counts
            # them freed); its full blocks stay cached.
            self.release([rid])
        if blocks:
            held.kv.attach(blocks)
        return Admitted(held, st.position, ids, st.context_hash, fresh, cached)

    def _cached_blocks(self, seed: int, ids: list[int], cached: int) -> list[int]:
        """The cached blocks holding the first `cached` of `ids`, every one confirmed (seed, token ids, and
        the chain of registrations); PREFIX_MISS unless all are there."""
        pool, block = self.pool, self.block
        if pool is None:
            raise Rejected(RejectReason.PREFIX_MISS, "this stage keeps no prefix cache")
        n = cached // block

        def confirm(i: int, b: int, entry, prev) -> bool:
            info: CachedBlock = entry.info
            return (info is not None and info.seed == seed and info.tokens == tuple(ids[i * block:(i + 1) * block])
                    and info.parent == (prev.serial if prev is not None else 0))

        found = pool.match(block_keys(seed, ids[:cached], block), confirm)
        pool.count_query(n, len(found))
        if len(found) < n:
            raise Rejected(RejectReason.PREFIX_MISS, f"{len(found)} of the {n} prefix blocks asked for are cached here")
        return found

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
            info = CachedBlock(state.hasher.seed, tuple(state.tokens[i * block:end]),
                               prev.serial if prev is not None else 0)
            pool.register(b, (state.hasher.seed, value), info)

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
