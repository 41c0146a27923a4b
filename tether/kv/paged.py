"""Paged KV: one arena of fixed-size blocks per model slice, and each request's table of the blocks it owns.

The arena lets the batch-invariant attention gather a whole micro-batch's keys in one op and write all its
new keys in one op, instead of a dozen ops per request. Sharing one tensor between requests is what the
owner tags guard: every block records a tag (the serial of the PagedKV it was handed to), blocks are zeroed
when handed out, and every step verifies that each block it reads or writes carries the tag its reader
expects. Full blocks may be shared read-only between requests through the prefix cache (tether/kv/blocks.py).
"""

from __future__ import annotations

import array
import itertools
import mmap

import torch

from tether.kv.blocks import BlockPool
from tether.mathutil import ceil_div

UNBOUNDED_BLOCKS = 1 << 40   # a reference model's arena (no stage pool): grows as far as memory lets it


def long_tensor(values) -> torch.Tensor:
    """An int64 tensor from Python ints, ~6x faster than torch.tensor for the short lists of a step's plan."""
    buf = array.array("q", values)
    return torch.frombuffer(buf, dtype=torch.int64) if buf else torch.empty(0, dtype=torch.int64)


class BlockArena:
    """Keys and values of every request on one slice: per layer a [blocks, kv_heads, block, head_dim] tensor.

    Which blocks are held, shared or cached is `pool`'s business (tether/kv/blocks.py, the same policy the
    coordinator's ledger runs); the arena holds the tensors and the owner tags. A bounded arena (a stage's pool)
    takes its whole capacity at once, never copied: its pages become resident as blocks are first handed out,
    unless `prefault` touches them all now, so that the process's RSS at start is what it will use. An unbounded
    one (a reference model's) grows by doubling (a copy, amortised) and never shrinks. Both start zeroed, and
    every block is zeroed again when it is handed out.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block: int,
                 max_blocks: int | None = None, prefault: bool = False) -> None:
        self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.block = (
            num_layers, kv_heads, head_dim, dtype, block)
        self.pool = BlockPool(max_blocks if max_blocks is not None else UNBOUNDED_BLOCKS)
        blocks = max_blocks or 0
        self._maps: list[mmap.mmap] = []   # the bounded arena's memory (the tensors view it)
        self.k = [self._mapped(blocks) for _ in range(num_layers)]
        self.v = [self._mapped(blocks) for _ in range(num_layers)]
        self.prefaulted = prefault and blocks > 0
        if self.prefaulted:
            for t in self.k + self.v:
                t.zero_()
        self.owner = torch.zeros(blocks, dtype=torch.long)   # tag of the blocks' contents; 0 = free
        self._serials = itertools.count(1)
        self._heads = torch.arange(kv_heads)

    def _zeros(self, blocks: int) -> torch.Tensor:
        return torch.zeros(blocks, self.kv_heads, self.block, self.head_dim, dtype=self.dtype)

    def _mapped(self, blocks: int) -> torch.Tensor:
        """Zeros in private anonymous memory: the kernel maps a page on its first touch, so the pool costs RSS
        only as its blocks are used (torch.zeros would write every page now)."""
        if blocks == 0:
            return self._zeros(0)
        shape = (blocks, self.kv_heads, self.block, self.head_dim)
        nbytes = blocks * self.kv_heads * self.block * self.head_dim * self.dtype.itemsize
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._maps.append(memory)
        return torch.frombuffer(memory, dtype=self.dtype).view(shape)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, keys and values."""
        return 2 * self.num_layers * self.kv_heads * self.block * self.head_dim * self.dtype.itemsize

    @property
    def touched_blocks(self) -> int:
        """Blocks whose memory is resident: every one when prefaulted, else those ever handed out (the pool
        hands out a never-used block only when no freed one is left, so this is its high-water mark)."""
        return self.num_blocks if self.prefaulted else min(self.pool.fresh, self.num_blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks the tensors have room for now (the pool's capacity bounds their growth)."""
        return self.owner.shape[0]

    @property
    def used_blocks(self) -> int:
        return self.pool.used

    def new_serial(self) -> int:
        return next(self._serials)

    def allocate(self, n: int, serial: int) -> list[int]:
        """Hand out n zeroed blocks tagged `serial` (NoCapacity when the pool cannot, evicting cached blocks
        nobody holds first)."""
        ids = self.pool.allocate(n)
        if ids and max(ids) >= self.num_blocks:
            self._grow(max(ids) + 1 - self.num_blocks)
        index = long_tensor(ids)
        for k, v in zip(self.k, self.v):   # a reused block must not show its last holder's keys
            k.index_fill_(0, index, 0)
            v.index_fill_(0, index, 0)
        self.owner[index] = serial
        return ids

    def attach(self, ids: list[int]) -> list[int]:
        """Share cached blocks (a prefix hit); returns their tags, which the new holder checks on every use."""
        self.pool.acquire(ids)
        return self.owner[long_tensor(ids)].tolist()

    def copy_positions(self, source: int, tag: int, dest: int, count: int) -> None:
        """Copy the first `count` positions of cached block `source` (which must still carry `tag`) into block
        `dest`, every layer: the same bits as computing them again (batch invariance)."""
        self.verify(long_tensor([source]), long_tensor([tag]))
        for k, v in zip(self.k, self.v):
            k[dest, :, :count] = k[source, :, :count]
            v[dest, :, :count] = v[source, :, :count]

    def release(self, ids: list[int], tags: list[int]) -> None:
        if not ids:
            return
        self.verify(long_tensor(ids), long_tensor(tags))
        freed = self.pool.release(ids)
        if freed:   # cached blocks keep their tag (and contents) until evicted
            self.owner[long_tensor(freed)] = 0

    def verify(self, blocks: torch.Tensor, serials: torch.Tensor) -> None:
        """Raise unless every block carries the tag its holder expects (a broken table must never read or
        write another request's keys, nor a cached block that was evicted and handed to someone else)."""
        if not torch.equal(self.owner.index_select(0, blocks), serials):   # index_select: half the cost of []
            raise RuntimeError("KV block table does not match the arena's owner tags")

    def _grow(self, at_least: int) -> None:
        old = self.num_blocks
        new = max(2 * old, old + at_least, 16)
        new = max(min(new, self.pool.capacity), old + at_least)
        for layers in (self.k, self.v):
            for i, t in enumerate(layers):
                grown = self._zeros(new)
                grown[:old] = t
                layers[i] = grown
        self.owner = torch.cat([self.owner, self.owner.new_zeros(new - old)])

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [blocks * kv_heads * block, head_dim] rows (views), for indexed writes."""
        return self.k[layer].view(-1, self.head_dim), self.v[layer].view(-1, self.head_dim)

    def flat_rows(self, blocks: list[int], offsets: list[int]) -> torch.Tensor:
        """Rows of `flat` holding positions (block, offset), every head: [positions * kv_heads], position-major
        (the order of k.reshape(-1, head_dim) for keys laid out [positions, kv_heads, head_dim])."""
        b, off = long_tensor(itertools.chain(blocks, offsets)).view(2, -1)
        return ((b[:, None] * self.kv_heads + self._heads) * self.block + off[:, None]).flatten()


class PagedKV:
    """One request's KV on one slice: the arena blocks it holds, in position order, and the tag each block
    must carry (its own blocks carry its serial; blocks shared from the prefix cache, the tag they had when
    cached).

    `length` counts positions whose K/V are complete. `written` is how far any step has written: a failed
    step can leave data past `length`, which is zeroed before a later step reads that block. A state started
    from part of a cached block holds that block (`_copy_from`) until `ensure` has copied its positions.
    """

    def __init__(self, arena: BlockArena, owner: str = "") -> None:
        self.arena = arena
        self.owner = owner          # request id this state belongs to (checked on use)
        self.serial = arena.new_serial()
        self.blocks: list[int] = []
        self.tags: list[int] = []
        self.length = 0
        self.written = 0
        self._copy_from: tuple[int, int, int] | None = None   # (cached block, its tag, positions) still to copy

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.arena.block

    def ensure(self, total: int) -> None:
        """Make room for `total` positions (NoCapacity when the pool cannot)."""
        need = ceil_div(total, self.arena.block) - len(self.blocks)
        if need > 0:
            first = len(self.blocks)
            self.blocks += self.arena.allocate(need, self.serial)
            self.tags += [self.serial] * need
            if self._copy_from is not None:
                source, tag, count = self._copy_from
                self.arena.copy_positions(source, tag, self.blocks[first], count)
                self._let_go_of_source()

    def attach(self, blocks: list[int], source: int | None = None, count: int = 0) -> None:
        """Start from cached blocks: a new state's first positions, read-only (writes only ever go past them);
        then, given a `source`, the first `count` positions of that cached block, copied into this state's own
        next block when `ensure` makes it (held meanwhile, so no allocation evicts it)."""
        if self.blocks or self._copy_from is not None:
            raise RuntimeError("a cached prefix can only start an empty KV state")
        held = blocks + ([source] if source is not None else [])
        tags = self.arena.attach(held)
        self.blocks, self.tags = list(blocks), tags[:len(blocks)]
        if source is not None:
            self._copy_from = (source, tags[-1], count)
        self.length = self.written = self.capacity + (count if source is not None else 0)

    def _let_go_of_source(self) -> None:
        assert self._copy_from is not None
        source, tag, _ = self._copy_from
        self._copy_from = None
        self.arena.release([source], [tag])

    def locate(self, start: int, end: int) -> tuple[list[int], list[int]]:
        """Block id and offset of each position start..end-1."""
        blk = self.arena.block
        return [self.blocks[p // blk] for p in range(start, end)], [p % blk for p in range(start, end)]

    def zero(self, start: int, end: int) -> None:
        """Zero positions start..end-1 in every layer."""
        end = min(end, self.capacity)
        if end <= start:
            return
        rows = self.arena.flat_rows(*self.locate(start, end))
        for layer in range(self.arena.num_layers):
            for t in self.arena.flat(layer):
                t.index_fill_(0, rows, 0)

    def gather(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of this request's keys and values at positions 0..end-1 (default: its length), each
        [kv_heads, end, head_dim], the plain layout (for inspection; attention reads the arena directly)."""
        end = self.length if end is None else end
        rows = self.arena.flat_rows(*self.locate(0, end))
        k, v = self.arena.flat(layer)
        shape = (end, self.arena.kv_heads, self.arena.head_dim)
        return k[rows].view(shape).transpose(0, 1), v[rows].view(shape).transpose(0, 1)

    def prepare_write(self, start: int, n: int) -> None:
        """Called before a step writes positions start..start+n-1: scrub what a failed step left past them."""
        end = start + n
        if self.written > end:
            self.zero(end, self.written)
        self.written = end

    def release(self) -> None:
        if self._copy_from is not None:
            self._let_go_of_source()
        self.arena.release(self.blocks, self.tags)
        self.blocks, self.tags, self.length, self.written = [], [], 0, 0
