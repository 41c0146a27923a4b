"""Batch-invariant kernels: a row's result never depends on the other rows of its micro-batch, on how its
request's prompt was chunked, or on the thread count.

What we found on torch 2.13 CPU (MKL sgemm, AVX-512; see docs/ARCHITECTURE.md "Batch invariance"):
- A GEMM row's bits depend on the row count M only through three classes: M = 1, M in {2, 3}, M >= 4.
  With T threads, MKL splits the rows among threads and a thread's share of 2-3 rows drops into the
  second class, so M in 5..7 and 9..11 broke with T = 2. Every M that is a multiple of 4*T agreed with
  every other such M and with 1-thread results, for every shape tried. Hence `padded_rows`.
- Vectorised elementwise ops (exp in silu and softmax) take a scalar path for a tensor's tail, whose
  results can differ by an ulp from the vector path. Padding rows to a multiple of 4*T keeps every
  tensor (and every thread's chunk of it) a multiple of the vector width when widths are multiples of 16.
- Attention runs per request over fixed-size key blocks: scores, block maxima and block sums have fixed
  shapes whatever the chunking; blocks are combined in a fixed sequential order (cumsum); a block past a
  query's position is fully masked and contributes exact zeros, so prefill, chunked prefill and decode agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Masked scores. Finite, so a fully masked block needs no special case: its weight exp(MASKED - row max)
# underflows to exactly 0 and it adds exact zeros to the fixed-order sums.
MASKED = -1e30


def padded_rows(rows: int, threads: int | None = None) -> int:
    """Row count that keeps every GEMM and elementwise op on one numeric path: a multiple of 4 * threads."""
    unit = 4 * (threads or torch.get_num_threads())
    return max(unit, -(-rows // unit) * unit)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


@dataclass(frozen=True)
class BlockMask:
    """What one request's attention needs besides q/k/v; the same for every layer of a step."""

    start: int
    rows: int            # group * n query rows (GQA heads folded into rows)
    padded: int          # rows padded by `padded_rows`
    blocks: int          # key blocks covering start + n
    bias: torch.Tensor   # [blocks, padded, block]: 0 where the key is visible, MASKED where not

    @classmethod
    def build(cls, start: int, n: int, group: int, block: int) -> "BlockMask":
        rows = group * n
        padded = padded_rows(rows)
        blocks = -(-(start + n) // block)
        pos = torch.arange(start, start + n).repeat(group)
        pos = torch.cat([pos, pos.new_full((padded - rows,), -1)])      # padding rows see no key
        visible = torch.arange(blocks * block).view(blocks, 1, block) <= pos.view(1, padded, 1)
        bias = torch.zeros(visible.shape).masked_fill_(~visible, MASKED)
        return cls(start, rows, padded, blocks, bias)


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """Causal attention of one request's queries over its own keys, in fixed key blocks.

    q: [H, n, d]; keys/values: [Hkv, blocks * block, d] (rows past the context finite). Returns [H, n, d].
    """
    heads, n, d = q.shape
    kv_heads = keys.shape[0]
    # GQA without repeating K/V: the query heads sharing one KV head become rows of one GEMM.
    qg = F.pad(q.reshape(kv_heads, mask.rows, d), (0, 0, 0, mask.padded - mask.rows))
    kb = keys.view(kv_heads, mask.blocks, -1, d)
    vb = values.view(kv_heads, mask.blocks, -1, d)
    scores = torch.add(mask.bias, torch.matmul(qg.unsqueeze(1), kb.transpose(-1, -2)), alpha=d ** -0.5)
    block_max = scores.amax(-1)                                           # [Hkv, blocks, padded]
    p = torch.exp(scores.sub_(block_max.unsqueeze(-1)))
    block_sum = p.sum(-1)
    block_out = torch.matmul(p, vb)                                       # [Hkv, blocks, padded, d]
    weight = torch.exp(block_max - block_max.amax(1, keepdim=True))       # 0 for fully masked blocks
    total = torch.cumsum(weight * block_sum, dim=1)[:, -1, : mask.rows]   # fixed, sequential order
    out = torch.cumsum(weight.unsqueeze(-1) * block_out, dim=1)[:, -1, : mask.rows]
    return (out / total.unsqueeze(-1)).reshape(heads, n, d)
