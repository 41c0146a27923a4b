"""rowdot on a GGUF file's own quantized groups (kernels/rowquant.c): the fp32 linears of a converted model,
reading ~5 bits a weight (Q4_1) or ~8.5 (Q8_0) instead of 32, with the same bits in every output.

Why: a decode step alone is memory-bound (it reads every weight once for one row), and the default model's fp32
weights were themselves rebuilt from the file's Q4_1 and Q8_0 groups at conversion. The kernel rebuilds each
weight in registers with the conversion's own float32 arithmetic and runs rowdot's chain on it, so its rows equal
rowdot's on the converted weight bit for bit. That is checked, not assumed: `prepare` dequantizes the blocks
with the kernel's own code and compares every value with the converted weight, and takes the blocks only where
all are equal (rowdot's fp32 blocks serve otherwise).

The conversion (tether/model/gguf_convert.py) keeps the file's blocks beside the fp32 weights, in
BLOCKS_FILE, as `<weight name>.<kind>` uint8 tensors [out, in / 32 * block bytes] in the converted row order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tether.mathutil import ceil_div
from tether.model import native, rowdot

log = logging.getLogger(__name__)

BLOCKS_FILE = "quant_blocks.safetensors"
GROUP = 32   # inputs per group, both kinds
# kind -> (kernels/rows.h's format, bytes of one GGUF block of GROUP weights)
KINDS = {"q4_1": (1, 20), "q8_0": (2, 34)}


@dataclass(frozen=True)
class Blocks:
    """One weight's GGUF blocks: `data` uint8 [out, in / 32 * block bytes], row j the blocks of output j."""

    kind: str
    data: torch.Tensor


def blocks_name(weight_name: str, kind: str) -> str:
    return f"{weight_name}.{kind}"


def split_name(name: str) -> tuple[str, str] | None:
    """(weight name, kind) of a blocks tensor's name, or None for any other tensor."""
    base, _, kind = name.rpartition(".")
    return (base, kind) if kind in KINDS and base else None


def prepare(weight: torch.Tensor, blocks: Blocks) -> rowdot.PackedWeight | None:
    """The blocks in rowquant's layout where they rebuild `weight` [out, in] (fp32) exactly, else None (logged)."""
    if blocks.kind not in KINDS:
        raise ValueError(f"rowquant: unknown block kind {blocks.kind!r}")
    fmt, block_bytes = KINDS[blocks.kind]
    n, k = weight.shape
    want = (n, k // GROUP * block_bytes)
    if weight.dtype != torch.float32 or k % GROUP or tuple(blocks.data.shape) != want or \
            blocks.data.dtype != torch.uint8:
        log.warning("rowquant: %s blocks %s do not fit a [%d, %d] %s weight: fp32 blocks serve it", blocks.kind,
                    tuple(blocks.data.shape), n, k, weight.dtype)
        return None
    lib = native.library()
    src = blocks.data.contiguous()
    packed = torch.empty(lib.rowquant_bytes(n, k, fmt), dtype=torch.uint8)
    lib.rowquant_pack(src.data_ptr(), n, k, fmt, packed.data_ptr())
    rebuilt = torch.empty(ceil_div(n, rowdot.BLOCK), k, rowdot.BLOCK, dtype=torch.float32)
    lib.rowquant_dequant(packed.data_ptr(), n, k, fmt, rebuilt.data_ptr())
    if not torch.equal(rebuilt.view(torch.int32), rowdot.pack(weight).data.view(torch.int32)):
        log.warning("rowquant: %s blocks of a [%d, %d] weight do not rebuild it bit for bit: fp32 blocks serve it",
                    blocks.kind, n, k)
        return None
    return rowdot.PackedWeight(packed, n, k, fmt)
