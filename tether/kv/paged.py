"""Paged KV: one arena of fixed-size blocks per model slice, and each request's table of the blocks it owns.

The arena lets the batch-invariant attention gather a whole micro-batch's keys in one op and write all its
new keys in one op, instead of a dozen ops per request. Sharing one tensor between requests is what the
owner tags guard: every block records the serial of the PagedKV holding it, blocks are zeroed when handed
out, and every step verifies that each block it reads or writes belongs to the request it reads it for.
"""

from __future__ import annotations

import array
import itertools

import torch

from tether.kv.cache import KVPool


def long_tensor(values) -> torch.Tensor:
    """An int64 tensor from Python ints, ~6x faster than torch.tensor for the short lists of a step's plan."""
    buf = array.array("q", values)
    return torch.frombuffer(buf, dtype=torch.int64) if buf else torch.empty(0, dtype=torch.int64)


class BlockArena:
    """Keys and values of every request on one slice: per layer a [blocks, kv_heads, block, head_dim] tensor.

    Grows by doubling (a copy, amortised) up to `max_blocks` and never shrinks; the stage's KVPool decides
    who may hold blocks, so the arena never needs more than the pool's capacity.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block: int,
                 max_blocks: int | None = None) -> None:
        self.num_layers, self.kv_heads, self.head_dim, self.dtype, self.block = (
            num_layers, kv_heads, head_dim, dtype, block)
        self.max_blocks = max_blocks
        self.k = [self._zeros(0) for _ in range(num_layers)]
        self.v = [self._zeros(0) for _ in range(num_layers)]
        self.owner = torch.zeros(0, dtype=torch.long)   # serial of the PagedKV holding a block; 0 = free
        self.free: list[int] = []                        # popped from the end: lowest ids first
        self._serials = itertools.count(1)
        self._heads = torch.arange(kv_heads)

    def _zeros(self, blocks: int) -> torch.Tensor:
        return torch.zeros(blocks, self.kv_heads, self.block, self.head_dim, dtype=self.dtype)

    @property
    def num_blocks(self) -> int:
        return self.owner.shape[0]

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def new_serial(self) -> int:
        return next(self._serials)

    def allocate(self, n: int, serial: int) -> list[int]:
        """Hand out n zeroed blocks to the holder `serial`."""
        if len(self.free) < n:
            self._grow(n - len(self.free))
        ids = [self.free.pop() for _ in range(n)]
        index = long_tensor(ids)
        for k, v in zip(self.k, self.v):   # a reused block must not show its last holder's keys
            k.index_fill_(0, index, 0)
            v.index_fill_(0, index, 0)
        self.owner[index] = serial
        return ids

    def release(self, ids: list[int], serial: int) -> None:
        if not ids:
            return
        index = long_tensor(ids)
        self.verify(index, torch.full((len(ids),), serial))
        self.owner[index] = 0
        self.free.extend(reversed(ids))

    def verify(self, blocks: torch.Tensor, serials: torch.Tensor) -> None:
        """Raise unless every block is held by the matching serial (a broken table must never read or write
        another request's keys)."""
        if not torch.equal(self.owner[blocks], serials):
            raise RuntimeError("KV block table does not match the arena's owner tags")

    def _grow(self, at_least: int) -> None:
        old = self.num_blocks
        new = max(2 * old, old + at_least, 16)
        if self.max_blocks is not None:
            new = max(min(new, self.max_blocks), old + at_least)
        for layers in (self.k, self.v):
            for i, t in enumerate(layers):
                grown = self._zeros(new)
                grown[:old] = t
                layers[i] = grown
        self.owner = torch.cat([self.owner, self.owner.new_zeros(new - old)])
        self.free[:0] = range(new - 1, old - 1, -1)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [blocks * kv_heads * block, head_dim] rows (views), for indexed writes."""
        return self.k[layer].view(-1, self.head_dim), self.v[layer].view(-1, self.head_dim)

    def flat_rows(self, blocks: list[int], offsets: list[int]) -> torch.Tensor:
        """Rows of `flat` holding positions (block, offset), every head: [positions * kv_heads], position-major
        (the order of k.reshape(-1, head_dim) for keys laid out [positions, kv_heads, head_dim])."""
        b, off = long_tensor(itertools.chain(blocks, offsets)).view(2, -1)
        return ((b[:, None] * self.kv_heads + self._heads) * self.block + off[:, None]).flatten()


class PagedKV:
    """One request's KV on one slice: the arena blocks it holds, in position order.

    `length` counts positions whose K/V are complete. `written` is how far any step has written: a failed
    step can leave data past `length`, which is zeroed before a later step reads that block.
    """

    def __init__(self, arena: BlockArena, pool: KVPool | None = None, owner: str = "") -> None:
        self.arena = arena
        self.pool = pool
        self.owner = owner          # request id this state belongs to (checked on use)
        self.serial = arena.new_serial()
        self.blocks: list[int] = []
        self.length = 0
        self.written = 0

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.arena.block

    def ensure(self, total: int) -> None:
        """Make room for `total` positions (reserving the new blocks from the pool first)."""
        block = self.arena.block
        need = -(-total // block) - len(self.blocks)
        if need <= 0:
            return
        if self.pool is not None:
            self.pool.reserve(need * block)
        try:
            self.blocks += self.arena.allocate(need, self.serial)
        except BaseException:
            if self.pool is not None:
                self.pool.free(need * block)
            raise

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
        self.arena.release(self.blocks, self.serial)
        if self.pool is not None:
            self.pool.free(self.capacity)
        self.blocks, self.length, self.written = [], 0, 0
