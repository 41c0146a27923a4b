"""rowdot on a GGUF file's Q4_1 and Q8_0 groups with llama.cpp's arithmetic (kernels/rowq8.c): each row's inputs
rounded to 8 bits per group of 32, integer dot products against the file's 4- or 8-bit weights (AVX-512 VNNI where
the CPU has it, AVX2 otherwise: the same integers), the groups combined in float32 in one fixed chain per output.

Why: float32 on the same groups (tether/model/rowquant.py) rebuilds every weight and multiplies in fp32, 16
products an instruction; the integer path makes 64 an instruction from the 4-bit weights directly. The price is
numerics: the inputs are rounded (as llama.cpp rounds them), so a row's bits are not float32's. They are still a
function of that row alone (batch-invariant by construction), and `reference` below computes them with torch
ops for the tests.
"""

from __future__ import annotations

import torch

from tether.model import native, rowdot, rowquant

GROUP = rowquant.GROUP
# kind -> (kernels/rows.h's WEIGHT_*_Q8 format, bytes of one GGUF block)
FORMATS = {"q4_1": (3, 20), "q8_0": (4, 34)}


def pack(blocks: rowquant.Blocks, out_features: int, in_features: int) -> rowdot.PackedWeight:
    """A weight's GGUF blocks [out, in / 32 * block bytes] in rowq8's layout."""
    if blocks.kind not in FORMATS:
        raise ValueError(f"rowq8 reads Q4_1 and Q8_0 groups, not {blocks.kind}")
    fmt, block_bytes = FORMATS[blocks.kind]
    n, k = out_features, in_features
    src = blocks.data.contiguous()
    if k % GROUP or tuple(src.shape) != (n, k // GROUP * block_bytes) or src.dtype != torch.uint8:
        raise ValueError(f"rowq8: {blocks.kind} blocks {tuple(src.shape)} do not fit a [{n}, {k}] weight")
    lib = native.library()
    packed = torch.empty(lib.rowq8_bytes(n, k, fmt), dtype=torch.uint8)
    lib.rowq8_pack(src.data_ptr(), n, k, fmt, packed.data_ptr())
    return rowdot.PackedWeight(packed, n, k, fmt)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [m, k] float32 -> (qx [m, k] int32 values in [-127, 127], dx [m, k / 32], sx [m, k / 32]), as the
    kernel rounds them."""
    m, k = x.shape
    g = x.reshape(m, k // GROUP, GROUP)
    dx = g.abs().amax(-1) / 127.0
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    q = torch.round((g * inv[..., None]).clamp(-127.0, 127.0)).to(torch.int32)
    sx = dx * q.sum(-1).to(torch.float32)
    return q.reshape(m, k), dx, sx


def reference(x: torch.Tensor, blocks: rowquant.Blocks) -> torch.Tensor:
    """x [m, k] @ w.T as rowq8 computes it, in torch ops, for the tests: the same roundings in the same order."""
    m, k = x.shape
    q4 = blocks.kind == "q4_1"
    raw = blocks.data.reshape(blocks.data.shape[0], k // GROUP, FORMATS[blocks.kind][1])
    n, groups = raw.shape[0], raw.shape[1]
    dw = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()     # [n, groups]
    if q4:
        mw = raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        nib = raw[..., 4:].to(torch.int32)
        qw = torch.cat([nib & 15, nib >> 4], dim=-1)                             # [n, groups, 32]
    else:
        qw = raw[..., 2:].contiguous().view(torch.int8).to(torch.int32)
    qx, dx, sx = quantize(x)
    qx = qx.reshape(m, groups, GROUP)
    acc = torch.zeros(m, n, dtype=torch.float32)
    for g in range(groups):
        isum = (qx[:, g, :].to(torch.int64) @ qw[:, g, :].to(torch.int64).T).to(torch.float32)   # exact
        acc = acc + (dw[None, :, g] * dx[:, g, None]) * isum
        if q4:
            acc = acc + mw[None, :, g] * sx[:, g, None]
    return acc
