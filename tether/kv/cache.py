"""The pool that bounds a stage's KV memory, and the contiguous per-request KV of the plain kernels.

With batch invariance on (the default) requests hold blocks of a paged arena instead (tether/kv/paged.py).
Either way the owner tag that travels with a request's KV is checked against its stamp chain before use.
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
        self.block = block          # capacity grows in multiples of it
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
        """Store k/v ([kv_heads, n, head_dim]) at positions start.."""
        end = start + k.shape[1]
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v

    def zero(self, start: int, end: int) -> None:
        """Zero positions start..end-1 in every layer."""
        for k, v in zip(self.k, self.v):
            k[:, start:end] = 0
            v[:, start:end] = 0

    def release(self) -> None:
        if self.pool is not None and self.num_layers:
            self.pool.free(self.capacity)
        self.k, self.v, self.capacity, self.length = [], [], 0, 0
