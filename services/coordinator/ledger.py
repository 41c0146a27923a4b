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

from collections.abc import Sequence

from tether.kv.blocks import BlockPool, block_keys
from tether.mathutil import ceil_div

UNBOUNDED = 1 << 40


class BlockLedger:
    def __init__(self, capacity_blocks: int = UNBOUNDED, block: int = 64, caching: bool = True) -> None:
        self.block = block
        self.caching = caching
        self.pool = BlockPool(capacity_blocks)
        self.held: dict[str, list[int]] = {}        # request id -> its blocks, in position order
        self.stale: dict[str, list[int]] = {}       # rebuilt: the old epoch's blocks, freed by the replay's first frame
        self.releasing: dict[str, list[int]] = {}   # a Release is under way: freed once every stage has answered
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

    def can_hold(self, rid: str, positions: int, prefix: Sequence[int] = ()) -> bool:
        """Whether `rid` can grow to `positions` positions now (starting from the cached blocks `prefix`, if
        given): its stale blocks are freed first, and attaching an unheld cached block takes it off the
        evictable list."""
        gain = sum(1 for b in self.stale.get(rid, ()) if self.pool.refs.get(b) == 1)
        taken = sum(1 for b in prefix if b in self.pool.evictable)
        return self.need(rid, positions) - len(prefix) <= self.pool.available + gain - taken

    def hold(self, rid: str, positions: int) -> None:
        """Grow `rid` to `positions` positions (NoCapacity if the pool cannot: check `can_hold` first). A
        rebuilt request's old blocks go first, as the stages free them when the replay's frame arrives."""
        stale = self.stale.pop(rid, None)
        if stale:
            self.pool.release(stale)
        blocks = self.held.setdefault(rid, [])
        more = self.blocks(positions) - len(blocks)
        if more > 0:
            blocks += self.pool.allocate(more)

    def coming_back(self) -> int:
        """Blocks that Releases under way will free (those no one else holds)."""
        return sum(1 for blocks in self.releasing.values() for b in blocks if self.pool.refs.get(b) == 1)

    def cached_prefix(self, seed: int, ids: list[int]) -> list[int]:
        """The cached blocks a new context can start from: the longest run of its full blocks, always leaving
        at least its last token to compute (the stages must produce its logits)."""
        if not self.caching or len(ids) <= self.block:
            return []
        usable = (len(ids) - 1) // self.block * self.block
        return self.pool.match(block_keys(seed, ids[:usable], self.block))

    def attach(self, rid: str, blocks: list[int]) -> None:
        """`rid` starts from these cached blocks (its first positions)."""
        stale = self.stale.pop(rid, None)
        if stale:
            self.pool.release(stale)
        assert not self.held.get(rid), "a cached prefix only starts an empty request"
        self.pool.acquire(blocks)
        self.held[rid] = list(blocks)

    def register(self, rid: str, seed: int, block_ends: list[int], start: int) -> None:
        """`rid`'s blocks start..len(block_ends)-1 became full, with these chain values at their ends: cache
        them as every stage does (tether/kv/blocks.py, services/stage_worker/state.py)."""
        if not self.caching:
            return
        blocks = self.held.get(rid, [])
        for i in range(start, min(len(block_ends), len(blocks))):
            b = blocks[i]
            if self.pool.entry(b) is not None:
                continue
            if i > 0 and self.pool.entry(blocks[i - 1]) is None and (
                    self.pool.lookup((seed, block_ends[i - 1])) is None):
                continue                     # no registered block before it: the stages do not cache it either
            self.pool.register(b, (seed, block_ends[i]))

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
