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

import torch


def padded_rows(rows: int, threads: int | None = None) -> int:
    """Row count that keeps every GEMM and elementwise op on one numeric path: a multiple of 4 * threads."""
    unit = 4 * (threads or torch.get_num_threads())
    return max(unit, -(-rows // unit) * unit)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                    block: int) -> torch.Tensor:
    """Causal attention of one request's queries over its own keys, in fixed key blocks.

    q: [H, n, d] for positions start..start+n-1; keys/values: [Hkv, Lp, d] with Lp a multiple of `block`
    covering start+n (rows past start+n must be finite). Returns [H, n, d].
    """
    heads, n, d = q.shape
    kv_heads, lp, _ = keys.shape
    group = heads // kv_heads
    nb = lp // block
    rows = group * n
    prows = padded_rows(rows)
    # GQA without repeating K/V: the `group` query heads sharing one KV head become rows of one GEMM.
    qg = pad_rows(q.reshape(kv_heads, rows, d).transpose(0, 1), prows).transpose(0, 1)   # [Hkv, prows, d]
    kb = keys.view(kv_heads, nb, block, d)
    vb = values.view(kv_heads, nb, block, d)
    scores = torch.matmul(qg.unsqueeze(1), kb.transpose(-1, -2)) * (d ** -0.5)            # [Hkv, nb, prows, B]
    pos = torch.arange(start, start + n).repeat(group)                                    # query position per row
    pos = torch.cat([pos, pos.new_full((prows - rows,), -1)])                             # padding rows: no keys
    key_pos = torch.arange(lp).view(nb, 1, block)
    allowed = key_pos <= pos.view(1, prows, 1)                                            # [nb, prows, B]
    scores = scores.masked_fill(~allowed, float("-inf"))
    block_max = scores.amax(-1)                                                           # [Hkv, nb, prows]
    safe_max = torch.where(torch.isinf(block_max), torch.zeros_like(block_max), block_max)
    p = torch.exp(scores - safe_max.unsqueeze(-1))
    block_sum = p.sum(-1)
    block_out = torch.matmul(p, vb)                                                       # [Hkv, nb, prows, d]
    row_max = block_max.amax(1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weight = torch.exp(block_max - row_max)                                               # 0 for masked blocks
    total = torch.cumsum(weight * block_sum, dim=1)[:, -1]                                # fixed order
    out = torch.cumsum(weight.unsqueeze(-1) * block_out, dim=1)[:, -1]                    # [Hkv, prows, d]
    out = out[:, :rows] / total[:, :rows].unsqueeze(-1)
    return out.reshape(kv_heads, group, n, d).reshape(heads, n, d)
