"""Block accounting with a prefix cache: which KV blocks are held, by how many requests, and which full blocks
are kept for reuse (pure logic: no tensors).

The same policy runs in two places: each stage's arena (real block ids, tensors behind them) and the
coordinator's ledger (the same ids, no tensors), so the coordinator can predict what every stage holds and
can take: it admits a request only when its blocks fit, preempts when decode growth runs out, and sends a
cached prefix only where the stages will have it (a stage still confirms every block itself).

A full block may be *registered* under a key (the context hash chain at the block's end, which is salted
with the model and the tenant's namespace). Registered blocks stay after their last holder lets go,
evictable in least-recently-used order when the pool needs room. A registered block is also found by the
chain's value after each of its first block - 1 tokens (its *inner keys*): a context that shares only the
start of a block (a short system prompt, then its own question) copies those positions into a block of its
own (`PrefixHit.source`), since a block is shared only whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.protocol.hashing import ContextHasher


class NoCapacity(Exception):
    """The KV budget (a stage's block pool, or the coordinator's ledger of it) cannot hold this many more
    tokens."""


def extend_by_blocks(hasher: ContextHasher, token_ids, block: int) -> list[int]:
    """Extend `hasher` by `token_ids`; return the chain's value at each block end it crossed, in order (the
    prefix-cache keys of the blocks those tokens filled, with the seed)."""
    ends = []
    at = 0
    while at < len(token_ids):
        take = min(len(token_ids) - at, block - hasher.length % block)
        value = hasher.extend(token_ids[at:at + take])
        at += take
        if hasher.length % block == 0:
            ends.append(value)
    return ends


def inner_keys(seed: int, token_ids, index: int, block: int) -> list[int]:
    """The inner keys of full block `index` of a context: the chain's value after each of its first block - 1
    tokens (seeded, so a tenant's keys are its own)."""
    hasher = ContextHasher(seed)
    hasher.extend(token_ids[:index * block])
    return hasher.extend_each(token_ids[index * block:(index + 1) * block - 1])


def block_keys(seed: int, token_ids: list[int], block: int) -> list[tuple[int, int]]:
    """The prefix-cache key of each full block of `token_ids`: (seed, the context chain's value at the
    block's end). The seed is in the key as well as in the chain: tenants never share a key."""
    return [(seed, v) for v in extend_by_blocks(ContextHasher(seed), token_ids, block)]


@dataclass
class Cached:
    """A registered block: its key, and what a holder must match to reuse it (the stage keeps the token ids
    and its parent's serial; the coordinator's ledger keeps nothing)."""

    key: Hashable
    serial: int                 # unique per registration: a child names its parent by it, never by block id
    info: Any = None
    inner: tuple[int, ...] = ()   # the inner keys this block answers (one block per key: the first registered)


def parent_serial(entry: Cached | None) -> int:
    """The serial a block's registration names as its parent: the registration before it, 0 for none (the
    context's first block)."""
    return entry.serial if entry is not None else 0


@dataclass(frozen=True)
class PrefixHit:
    """Where a new context's first positions are cached: whole blocks to share, then possibly the first
    `count` positions of one more cached block (`source`), copied into a block of the context's own."""

    blocks: list[int] = field(default_factory=list)
    source: int | None = None
    count: int = 0

    def tokens(self, block: int) -> int:
        """Positions the hit covers (the slot's `cached_prefix`)."""
        return len(self.blocks) * block + self.count

    def held(self) -> list[int]:
        """Every cached block the hit reads: while it is taken none of them may be evicted."""
        return self.blocks + ([self.source] if self.source is not None else [])

    def __bool__(self) -> bool:
        return bool(self.blocks) or self.source is not None


NO_HIT = PrefixHit()


@dataclass
class BlockCounters:
    queries: int = 0            # prefix lookups
    hits: int = 0               # lookups that found every block asked for
    hit_blocks: int = 0         # of them, whole blocks shared
    hit_tokens: int = 0         # positions the hits covered (whole blocks and copied parts)
    evictions: int = 0          # cached blocks evicted to make room


@dataclass
class BlockPool:
    capacity: int                                        # blocks
    refs: dict[int, int] = field(default_factory=dict)   # block -> holders (> 0)
    free: list[int] = field(default_factory=list)        # used before, now free (reused before fresh ids)
    cached: dict[Hashable, int] = field(default_factory=dict)      # key -> block
    entries: dict[int, Cached] = field(default_factory=dict)       # block -> its registration
    inner: dict[int, int] = field(default_factory=dict)            # inner key -> block
    evictable: OrderedDict[int, None] = field(default_factory=OrderedDict)   # cached, no holder: LRU first
    counters: BlockCounters = field(default_factory=BlockCounters)
    fresh: int = 0                                       # ids below it have been handed out before
    _serial: int = 0

    # --- figures ----------------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Blocks some request holds."""
        return len(self.refs)

    @property
    def available(self) -> int:
        """Blocks an allocation can get: free ones, then evictable cached ones."""
        return len(self.free) + (self.capacity - self.fresh) + len(self.evictable)

    # --- holding ----------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks for a new holder: free ones first, then the least recently used cached ones (evicted).
        All or nothing: NoCapacity leaves the pool as it was."""
        if n > self.available:
            raise NoCapacity(f"KV capacity exhausted: {self.used} of {self.capacity} blocks held, {n} more "
                             f"needed")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            elif self.fresh < self.capacity:
                b, self.fresh = self.fresh, self.fresh + 1
            else:
                b, _ = self.evictable.popitem(last=False)
                self._forget(b)
                self.counters.evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def acquire(self, blocks: list[int]) -> None:
        """Another holder for cached blocks (a prefix hit)."""
        for b in blocks:
            if b not in self.entries:
                raise ValueError(f"block {b} is not cached")
        for b in blocks:
            n = self.refs.get(b, 0)
            if n == 0:
                del self.evictable[b]
            self.refs[b] = n + 1

    def release(self, blocks: list[int]) -> list[int]:
        """One holder lets go of each block; returns the blocks now unused and uncached (truly free), whose
        contents the caller may drop. A cached block with no holder stays, evictable."""
        freed = []
        for b in blocks:
            n = self.refs[b] - 1
            if n > 0:
                self.refs[b] = n
                continue
            del self.refs[b]
            if b in self.entries:
                self.evictable[b] = None          # most recently used end
            else:
                self.free.append(b)
                freed.append(b)
        return freed

    # --- the prefix cache -------------------------------------------------------------------------------
    def register(self, block: int, key: Hashable, info: Any = None, inner: Sequence[int] = ()) -> Cached | None:
        """Keep a full, held block for reuse under `key`, and findable by those of its `inner` keys no other
        cached block answers. A key already cached keeps its first block (the new one stays private to its
        holder). Returns the registration, or None."""
        if key in self.cached or block in self.entries or block not in self.refs:
            return None
        self._serial += 1
        owned = tuple(k for k in inner if k not in self.inner)
        entry = Cached(key, self._serial, info, owned)
        self.cached[key] = block
        self.entries[block] = entry
        for k in owned:
            self.inner[k] = block
        return entry

    def lookup(self, key: Hashable) -> int | None:
        return self.cached.get(key)

    def entry(self, block: int) -> Cached | None:
        return self.entries.get(block)

    def match(self, keys: Sequence[Hashable], confirm=None) -> list[int]:
        """The longest run of cached blocks for `keys` (one per block, in order), each confirmed by
        `confirm(i, block, entry, previous entry)` when given. Counts the query; touches nothing."""
        out: list[int] = []
        prev: Cached | None = None
        for i, key in enumerate(keys):
            b = self.cached.get(key)
            if b is None:
                break
            entry = self.entries[b]
            if confirm is not None and not confirm(i, b, entry, prev):
                break
            out.append(b)
            prev = entry
        return out

    def match_inner(self, values: Sequence[int], confirm=None) -> tuple[int, int] | None:
        """The longest start of a cached block that continues a context: `values` are the chain's values after
        each of its next tokens; returns (block, tokens) for the last value some cached block answers and
        `confirm(block, entry, tokens)` accepts, else None. Touches nothing."""
        for n in range(len(values), 0, -1):
            b = self.inner.get(values[n - 1])
            if b is not None and (confirm is None or confirm(b, self.entries[b], n)):
                return b, n
        return None

    def count_query(self, asked: int, found: int, tokens: int) -> None:
        """One lookup for `tokens` positions: `asked` whole blocks (and part of one more), `found` of them
        there; a hit when everything asked was."""
        self.counters.queries += 1
        if tokens and found >= asked:
            self.counters.hits += 1
            self.counters.hit_blocks += asked
            self.counters.hit_tokens += tokens

    def drop_cache(self) -> list[int]:
        """Forget every registration (a peer restarted, or caching turned off); unheld blocks become free.
        Returns the blocks freed."""
        freed = list(self.evictable)
        self.evictable.clear()
        self.cached.clear()
        self.entries.clear()
        self.inner.clear()
        self.free.extend(freed)
        return freed

    def _forget(self, block: int) -> None:
        entry = self.entries.pop(block)
        del self.cached[entry.key]
        for k in entry.inner:
            del self.inner[k]
