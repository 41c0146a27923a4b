"""The coordinator's block ledger: every stage's KV pool and prefix cache, mirrored (pure logic).

Every stage of a route holds the same positions of the same requests, and runs the same block policy
(tether/kv/blocks.py) in the same order: the coordinator decides every allocation (frames, in order) and
every release. So one BlockPool here, sized to the smallest stage, predicts what each stage holds and can
take. It is kept conservative — blocks count as held here from before a stage allocates them until after
every stage has let go — so the stages never run out where the ledger did not, and a prefix the ledger
believes cached is almost always cached on the stages too. The stages stay the authority: a prefix they
cannot confirm is refused (PREFIX_MISS) and replayed cold, never trusted.
"""

from __future__ import annotations

from tether.kv.blocks import NO_HIT, BlockPool, PrefixHit, block_keys, inner_keys, parent_serial
from tether.mathutil import ceil_div
from tether.protocol.hashing import ContextHasher

UNBOUNDED = 1 << 40


class BlockLedger:
    def __init__(self, capacity_blocks: int = UNBOUNDED, block: int = 64, caching: bool = True) -> None:
        self.block = block
        self.caching = caching
        self.pool = BlockPool(capacity_blocks)
        self.held: dict[str, list[int]] = {}        # request id -> its blocks, in position order
        self.stale: dict[str, list[int]] = {}       # rebuilt: the old epoch's blocks, freed by the replay's first frame
        self.releasing: dict[str, list[int]] = {}   # a Release is under way: freed once every stage has answered
        self.copying: dict[str, int] = {}           # a new request's cached block to copy from: held until `hold`
        self.generation = 0      # bumped whenever the mirrored cache is forgotten (in load reports: routing's
                                 # prefix affinity to this pipeline is void from then on)

    # --- sizing ------------------------------------------------------------------------------------------
    def configure(self, capacity_blocks: int, block: int, caching: bool) -> None:
        """The route's figures from the handshake. The block size never changes under held blocks (it is a
        build constant); a restarted route may have forgotten its cache, so the mirror forgets it too."""
        self.pool.capacity = capacity_blocks
        self.block = block
        self.caching = caching
        self.forget_cache()

    def forget_cache(self) -> None:
        """Forget what the stages have cached (they may have restarted, or a stage refused a predicted hit):
        only hits are lost, never correctness."""
        self.pool.drop_cache()
        self.generation += 1

    def blocks(self, positions: int) -> int:
        return ceil_div(positions, self.block)

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def fits(self, positions: int) -> bool:
        """Whether a context of this many positions can ever be held (alone, with every cached block evicted)."""
        return self.blocks(positions) <= self.pool.capacity

    # --- a request's blocks ------------------------------------------------------------------------------
    def need(self, rid: str, positions: int) -> int:
        """Blocks `rid` must still get to hold `positions` positions."""
        return max(0, self.blocks(positions) - len(self.held.get(rid, ())))

    def can_hold(self, rid: str, positions: int, hit: PrefixHit = NO_HIT) -> bool:
        """Whether `rid` can grow to `positions` positions now (starting from the cached prefix `hit`, if
        given): its stale blocks are freed first, and taking an unheld cached block takes it off the
        evictable list."""
        gain = sum(1 for b in self.stale.get(rid, ()) if self.pool.refs.get(b) == 1)
        taken = sum(1 for b in hit.held() if b in self.pool.evictable)
        return self.need(rid, positions) - len(hit.blocks) <= self.pool.available + gain - taken

    def hold(self, rid: str, positions: int) -> None:
        """Grow `rid` to `positions` positions (NoCapacity if the pool cannot: check `can_hold` first). A
        rebuilt request's old blocks go first, as the stages free them when the replay's frame arrives; a
        block copied from is let go once the new blocks are taken, as the stages do."""
        stale = self.stale.pop(rid, None)
        if stale:
            self.pool.release(stale)
        blocks = self.held.setdefault(rid, [])
        more = self.blocks(positions) - len(blocks)
        if more > 0:
            blocks += self.pool.allocate(more)
        source = self.copying.pop(rid, None)
        if source is not None:
            self.pool.release([source])

    def coming_back(self) -> int:
        """Blocks that Releases under way will free (those no one else holds)."""
        return sum(1 for blocks in self.releasing.values() for b in blocks if self.pool.refs.get(b) == 1)

    def cached_prefix(self, seed: int, ids: list[int]) -> PrefixHit:
        """Where a new context can start from the cache: the longest run of its full blocks, then the longest
        start of one more cached block, always leaving at least its last token to compute (the stages must
        produce its logits). Each block is linked to the one matched before it, as the stages check."""
        if not self.caching or len(ids) <= 1:
            return NO_HIT
        block = self.block
        keys = block_keys(seed, ids[:(len(ids) - 1) // block * block], block)
        found = self.pool.match(keys, lambda i, b, entry, prev: entry.info == parent_serial(prev))
        start = len(found) * block
        hasher = ContextHasher(seed)
        hasher.extend(ids[:start])
        parent = parent_serial(self.pool.entry(found[-1]) if found else None)
        part = self.pool.match_inner(hasher.extend_each(ids[start:min(start + block, len(ids)) - 1]),
                                     lambda b, entry, n: entry.info == parent)
        return PrefixHit(found, *part) if part else PrefixHit(found)

    def attach(self, rid: str, hit: PrefixHit) -> None:
        """`rid` starts from the cached prefix `hit` (its first positions); a block it copies from stays held
        until `hold` has taken the new blocks, as on the stages."""
        stale = self.stale.pop(rid, None)
        if stale:
            self.pool.release(stale)
        assert not self.held.get(rid), "a cached prefix only starts an empty request"
        self.pool.acquire(hit.held())
        self.held[rid] = list(hit.blocks)
        if hit.source is not None:
            self.copying[rid] = hit.source

    def register(self, rid: str, seed: int, ids: list[int], block_ends: list[int], start: int) -> None:
        """`rid`'s blocks start..len(block_ends)-1 became full (its context `ids`, with these chain values at
        the blocks' ends): cache them as every stage does, each linked to the registration before it, with
        their inner keys (tether/kv/blocks.py, services/stage_worker/state.py)."""
        if not self.caching:
            return
        blocks = self.held.get(rid, [])
        for i in range(start, min(len(block_ends), len(blocks))):
            b = blocks[i]
            if self.pool.entry(b) is not None:
                continue
            prev = None
            if i > 0:
                prev = self.pool.entry(blocks[i - 1])
                if prev is None:             # the block before is private: link to the cached twin, if any
                    twin = self.pool.lookup((seed, block_ends[i - 1]))
                    prev = self.pool.entry(twin) if twin is not None else None
                    if prev is None:
                        continue             # no registered block before it: the stages do not cache it either
            if self.pool.lookup((seed, block_ends[i])) is None:    # else a twin holds the key: b stays private
                self.pool.register(b, (seed, block_ends[i]), parent_serial(prev), inner_keys(seed, ids, i, self.block))

    def rebuild(self, rid: str) -> None:
        """`rid` will be replayed from position 0 under a new epoch: the stages keep its old blocks until the
        replay's first frame reaches them."""
        blocks = self.held.pop(rid, [])
        if blocks:
            self.stale.setdefault(rid, []).extend(blocks)

    def release_begin(self, rid: str) -> None:
        """A Release of `rid` is on its way to the stages: its blocks stay counted until it is answered."""
        blocks = self.held.pop(rid, []) + self.stale.pop(rid, [])
        if blocks:
            self.releasing.setdefault(rid, []).extend(blocks)

    def release_done(self, rid: str) -> None:
        """Every stage let go of `rid` (or gave up trying: the stages' leases free it)."""
        blocks = self.releasing.pop(rid, None)
        if blocks:
            self.pool.release(blocks)

    # --- figures -----------------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return self.pool.used

    @property
    def cached(self) -> int:
        return len(self.pool.evictable)

