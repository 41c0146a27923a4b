"""KV cache of one request on one model slice, and the pool that bounds a stage's KV memory.

Each request owns its buffers outright (no block table to cross between requests); the owner tag that
travels with the buffers is checked against the request's stamp chain before every use.
"""

from __future__ import annotations

import torch


class NoCapacity(Exception):
    """The stage's KV budget cannot hold this many more tokens."""


class KVPool:
    """Counts reserved KV token slots against a fixed budget (one per stage)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0

    def reserve(self, n: int) -> None:
        if self.used_tokens + n > self.capacity_tokens:
            raise NoCapacity(f"KV capacity exhausted: {self.used_tokens}+{n} > {self.capacity_tokens} tokens")
        self.used_tokens += n

    def free(self, n: int) -> None:
        self.used_tokens -= n
        assert self.used_tokens >= 0, "KV pool freed more than it reserved"


class KVCache:
    """Keys and values of one request for a contiguous range of layers.

    Buffers are [kv_heads, capacity, head_dim] per layer and grow by doubling. `length` counts the
    tokens whose K/V are complete; rows past it may hold a partial write of a failed step and are never read.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 pool: KVPool | None = None, owner: str = "", block: int = 64) -> None:
        self.block = block          # capacity is a multiple of it; attention reads whole blocks
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.pool = pool
        self.owner = owner          # request id this state belongs to (checked on use)
        self.length = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def ensure(self, total: int) -> None:
        """Make room for `total` tokens (reserving the growth from the pool first)."""
        if total <= self.capacity or self.num_layers == 0:
            self.capacity = max(self.capacity, total)
            return
        new_cap = -(-max(total, 2 * self.capacity) // self.block) * self.block
        if self.pool is not None:
            self.pool.reserve(new_cap - self.capacity)
        shape = (self.kv_heads, new_cap, self.head_dim)
        for i in range(self.num_layers):
            k = torch.empty(shape, dtype=self.dtype)
            v = torch.empty(shape, dtype=self.dtype)
            if self.capacity:
                k[:, : self.length] = self.k[i][:, : self.length]
                v[:, : self.length] = self.v[i][:, : self.length]
                self.k[i], self.v[i] = k, v
            else:
                self.k.append(k)
                self.v.append(v)
        self.capacity = new_cap

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v ([kv_heads, n, head_dim]) at positions start..; zero the rest of the last block, so
        whole-block reads never meet garbage (a masked key still multiplies its value by zero)."""
        end = start + k.shape[1]
        block_end = min(-(-end // self.block) * self.block, self.capacity)
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        self.k[layer][:, end:block_end] = 0
        self.v[layer][:, end:block_end] = 0

    def blocks(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the whole blocks covering positions 0..length-1 (views, no copy)."""
        end = -(-length // self.block) * self.block
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def release(self) -> None:
        if self.pool is not None and self.num_layers:
            self.pool.free(self.capacity)
        self.k, self.v, self.capacity, self.length = [], [], 0, 0
