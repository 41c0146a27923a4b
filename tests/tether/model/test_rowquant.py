"""rowquant (tether/model/rowquant.py, kernels/rowquant.c): a GGUF file's Q4_1 / Q8_0 groups, read in place of the
fp32 weight they were converted to, give every row rowdot's bits on that weight; blocks that do not rebuild the
weight exactly are never taken. Skipped where our kernels cannot be built."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tether.model import native, rowdot, rowquant

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"our kernels do not run here: {native.available()}")

TYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
# (out, in): smollm2's shapes, columns ending mid-block, an odd number of column blocks (the one-row pairs)
SHAPES = [(576, 576), (192, 576), (576, 1536), (40, 64), (17, 32), (48, 96)]


def converted(kind: str, out: int, inner: int, seed: int) -> tuple[torch.Tensor, rowquant.Blocks]:
    """A random weight quantized as the file would hold it, and the fp32 weight the conversion makes of it
    (gguf's own dequantize, as tether/model/gguf_convert.py calls it)."""
    w = np.random.default_rng(seed).standard_normal((out, inner)).astype(np.float32)
    blocks = quantize(w, TYPES[kind])
    fp32 = np.array(dequantize(blocks, TYPES[kind]), dtype=np.float32).reshape(out, inner)
    return torch.from_numpy(fp32), rowquant.Blocks(kind, torch.from_numpy(np.ascontiguousarray(blocks)))


@pytest.fixture(params=["auto", "avx2"])
def isa(request):
    """Each test on the kernels the CPU runs and on the AVX2 ones (forced), whose one-row and buffered paths an
    AVX-512 machine would otherwise never take."""
    lib = native.library()
    was = lib.kernels_isa(-1)
    if request.param == "avx2":
        lib.kernels_isa(0)
    try:
        yield request.param
    finally:
        lib.kernels_isa(1 if was else 0)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("out, inner", SHAPES)
def test_rows_equal_rowdot_on_the_converted_weight(kind, out, inner, isa):
    """Every window of m rows (1; each AVX2 tile that rebuilds its weights, 2-6 rows both halves of a block, 7-8
    one half a pass; past them the buffer; past a 64-row chunk) on 1 and 2 threads, with and without the fused
    SiLU: the same bits as rowdot on the fp32 weight."""
    weight, blocks = converted(kind, out, inner, out * 7 + inner)
    packed = rowquant.prepare(weight, blocks)
    assert packed is not None and packed.format == rowquant.KINDS[kind][0]
    assert packed.data.numel() < rowdot.pack(weight).data.numel() * 4 / 3   # ~5 or ~8.5 bits a weight, not 32
    plain = rowdot.pack(weight)
    x = torch.randn(70, inner, generator=torch.Generator().manual_seed(out))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 25, 32, 33, 64, 70):
                assert torch.equal(rowdot.linear(x[:m], packed), rowdot.linear(x[:m], plain)), f"{m} rows"
            assert torch.equal(rowdot.silu_linear(x[:1], packed), rowdot.silu_linear(x[:1], plain))
            for m in (4, 7, 9):
                assert torch.equal(rowdot.silu_linear(x[:m], packed), rowdot.silu_linear(x[:m], plain)), f"{m} rows"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", TYPES)
def test_blocks_that_do_not_rebuild_the_weight_are_not_taken(kind):
    weight, blocks = converted(kind, 48, 96, 5)
    nudged = weight.clone()
    nudged[31, 77] = torch.nextafter(nudged[31, 77], torch.tensor(1e9))   # one value one ulp off
    assert rowquant.prepare(nudged, blocks) is None
    assert rowquant.prepare(weight[:, :64].contiguous(), blocks) is None   # blocks of another shape
    assert rowquant.prepare(weight, blocks) is not None


def test_blocks_names_round_trip():
    assert rowquant.split_name(rowquant.blocks_name("model.layers.3.mlp.up_proj.weight", "q4_1")) == \
        ("model.layers.3.mlp.up_proj.weight", "q4_1")
    assert rowquant.split_name("model.layers.3.mlp.up_proj.weight") is None


@pytest.mark.parametrize("kind", TYPES)
def test_the_avx512_row_kernel_gives_the_avx2_bits(kind):
    """Where the CPU has AVX-512, one row and 2-32 rows run on its kernels: the AVX2 ones' bits (forced here)."""
    lib = native.library()
    if not lib.kernels_isa(1):
        pytest.skip("no AVX-512 (F, BW, DQ, VL) here: one row runs in AVX2 only")
    weight, blocks = converted(kind, 200, 576, 3)   # 13 column blocks: fours and a remainder
    packed = rowquant.prepare(weight, blocks)
    assert packed is not None
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(9))

    def run() -> list[torch.Tensor]:   # one row each, then the tiles that rebuild their weights (2-32 rows)
        return [rowdot.linear(x[i:i + 1], packed) for i in range(4)] + [rowdot.silu_linear(x[:1], packed)] + \
            [rowdot.linear(x[:m], packed) for m in (2, 8, 13)] + [rowdot.silu_linear(x[:5], packed)]
    try:
        wide = run()
        lib.kernels_isa(0)
        narrow = run()   # AVX2: one row in registers, more rows through the buffer and rowdot's AVX2 tiles
    finally:
        lib.kernels_isa(1)
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow))
    assert torch.equal(torch.cat(wide[:4]), rowdot.linear(x[:4], rowdot.pack(weight)))
