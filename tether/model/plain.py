"""The plain kernels, a benchmark baseline only: contiguous per-request KV and one SDPA call per request.

They are what bench/batch_invariance.py measures the batch-invariant kernels against ("plain" vs
"invariant"). They are not batch invariant (a request's logits may change with its batch neighbours), so
serving never imports this module: stages, the coordinator's reference and the load tool's baselines all run
ModelSlice's paged path (tether/model/llama.py). `PlainSlice` runs a loaded ModelSlice's own weights.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from tether.model.llama import ModelSlice, SlotRows
from tether.mathutil import ceil_div


class KVCache:
    """Keys and values of one request for a contiguous range of layers.

    Buffers are [kv_heads, capacity, head_dim] per layer and grow by doubling. `length` counts the
    tokens whose K/V are complete; rows past it may hold a partial write of a failed step and are never read.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block: int = 64) -> None:
        self.block = block          # capacity grows in multiples of it
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.length = 0
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def ensure(self, total: int) -> None:
        """Make room for `total` tokens."""
        if total <= self.capacity or self.num_layers == 0:
            self.capacity = max(self.capacity, total)
            return
        new_cap = ceil_div(max(total, 2 * self.capacity), self.block) * self.block
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

    def release(self) -> None:
        self.k, self.v, self.capacity, self.length = [], [], 0, 0


class PerSlotAttention:
    """A micro-batch's attention as the plain kernels run it (llama.Attend): one SDPA call per request over
    its contiguous KV."""

    def __init__(self, slots: list[SlotRows], gqa: bool) -> None:
        self.slots = slots
        self.gqa = gqa

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q: [n, heads, d], k and v: [n, kv_heads, d] -> [n, heads * d]."""
        n = q.shape[0]
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out = torch.zeros_like(q)
        row = 0
        for s in self.slots:  # each request attends to its own keys only
            rows = slice(row, row + s.length)
            kv = cast(KVCache, s.kv)   # a plain slot carries its contiguous KVCache, not paged KV
            kv.write(layer, s.start, k[:, rows], v[:, rows])
            total = s.start + s.length
            keys, values = kv.k[layer][:, :total], kv.v[layer][:, :total]
            mask = None
            if s.length > 1:
                mask = (torch.arange(total)[None, :] <= torch.arange(s.start, total)[:, None])
            out[:, rows] = F.scaled_dot_product_attention(
                q[:, rows].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                attn_mask=mask, enable_gqa=self.gqa).squeeze(0)
            row += s.length
        return out.transpose(0, 1).reshape(n, -1)


class PlainSlice:
    """A ModelSlice's weights run by the plain kernels: no row padding, torch's own threads, KVCache and
    PerSlotAttention instead of the paged arena and the tiles."""

    def __init__(self, model: ModelSlice, kernel: str = "mkl") -> None:
        self.model = model
        model.use_linear_kernel(kernel)   # torch's own F.linear by default (invariant.KERNELS)
        self.cfg = model.cfg
        self.num_layers = model.num_layers
        self.dtype = model.dtype

    def new_kv(self) -> KVCache:
        return KVCache(self.num_layers, self.cfg.num_key_value_heads, self.cfg.head_dim, self.dtype)

    def attention(self, slots: list[SlotRows]) -> PerSlotAttention:
        return PerSlotAttention(slots, self.cfg.num_attention_heads != self.cfg.num_key_value_heads)

    @torch.inference_mode()
    def __call__(self, inputs: torch.Tensor, slots: list[SlotRows]) -> torch.Tensor:
        """As ModelSlice.forward; each slot's KV from `new_kv`, with room already made (`kv.ensure`)."""
        return self.model.run_layers(inputs, slots, inputs.shape[0], self.attention(slots))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.norm(hidden)).float()
