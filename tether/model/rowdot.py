"""The rowdot kernel (kernels/rowdot.c): fp32 linears whose every output is one multiply-add chain over k in
order, so a row's bits never depend on the row count, the tiling or the thread: batch-invariant with no padding.

Why our own: on an AMD EPYC without AVX-512 (AVX2, FMA) MKL's small-M sgemm is slow and its rows change
with M (padded to 4 rows a step), and oneDNN's fp32 rows agree only from 2 rows and cost more. rowdot reads
each weight once per call at any row count up to 64 (smollm2's 15 layers' linears at 1 row: see
docs/PERFORMANCE.md). It is compiled on the machine that serves (tether/model/native.py): where it cannot be built, the
numerics probe, which decides whether a kernel serves, skips it (tether/model/numerics.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.mathutil import ceil_div
from tether.model import native

BLOCK = 16   # output columns per packed block (kernels/rows.h's BLOCK)
F32 = 0      # PackedWeight.format of rowdot's own fp32 blocks (kernels/rows.h's WEIGHT_F32)


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] weight as the kernels read it: rowdot's fp32 blocks [ceil(out / 16), in, 16] (columns past
    `out` zero), or, with another `format`, rowquant's blocks of a GGUF file's groups (tether/model/rowquant.py),
    which rebuild the same fp32 values."""

    data: torch.Tensor
    out_features: int
    in_features: int
    format: int = F32


def pack(weight: torch.Tensor) -> PackedWeight:
    """`weight` [out, in] (fp32) in rowdot's blocked layout, made once per weight."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise native.Unavailable(f"rowdot packs 2-d float32 weights, not {weight.dtype} {tuple(weight.shape)}")
    lib = native.library()
    w = weight.detach().contiguous()
    n, k = w.shape
    out = torch.empty(ceil_div(n, BLOCK), k, BLOCK, dtype=torch.float32)
    lib.rowdot_pack(w.data_ptr(), n, k, out.data_ptr())
    return PackedWeight(out, n, k)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, silu: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias; silu of the product where `silu`) over the last dimension of `x`, on torch's thread
    count (split by output columns); every row's bits independent of the others and of the threads."""
    lib = native.library()
    lead, k = x.shape[:-1], x.shape[-1]
    if k != weight.in_features or x.dtype != torch.float32:
        raise ValueError(f"rowdot: input [..., {k}] {x.dtype} against a weight of {weight.in_features} inputs")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], weight.out_features
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib.rowdot(rows.data_ptr(), rows.stride(0), weight.data.data_ptr(), weight.format, k, y.data_ptr(), n, n, m,
                   torch.get_num_threads(), int(silu))
    if bias is not None:
        y += bias
    return y.view(*lead, n)


def silu_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ weight.T), the SiLU fused into the kernel (one vector code for every element: ATen's SiLU takes
    a scalar path for each thread chunk's tail, so its bits follow the tensor's size and the threads)."""
    if bias is not None:   # a gate projection has none in the families we load (tether/model/llama.py)
        raise ValueError("rowdot's fused SiLU takes no bias")
    return linear(x, weight, silu=True)
