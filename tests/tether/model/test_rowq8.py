"""rowq8 (tether/model/rowq8.py, kernels/rowq8.c): a GGUF file's Q4_1 groups against inputs rounded to 8 bits, as
llama.cpp computes them. Every row equals the torch transcription of the arithmetic (`rowq8.reference`) bit for
bit, on any row count, thread count and instruction set; a model served so names it in its rule and fingerprint.
Skipped where our kernels cannot be built."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tether.model import native, rowdot, rowq8, rowquant, smollm2
from tether.model.config import even_split
from tether.model.llama import SlotRows
from tether.model.loader import load_model_tokenizer, load_slice, resolve_model
from tests.helpers import run_chunks

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"our kernels do not run here: {native.available()}")

# (out, in): smollm2's shapes, columns ending mid-block, an odd number of column blocks, one group
SHAPES = [(576, 576), (192, 576), (576, 1536), (40, 64), (17, 32), (200, 96)]


TYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def file_blocks(out: int, inner: int, seed: int, kind: str = "q4_1") -> tuple[torch.Tensor, rowquant.Blocks]:
    w = np.random.default_rng(seed).standard_normal((out, inner)).astype(np.float32)
    blocks = quantize(w, TYPES[kind])
    fp32 = np.array(dequantize(blocks, TYPES[kind]), dtype=np.float32).reshape(out, inner)
    return torch.from_numpy(fp32), rowquant.Blocks(kind, torch.from_numpy(np.ascontiguousarray(blocks)))


def isas() -> list[int]:
    """kernels_isa settings to run: AVX2 always, AVX-512 (VNNI) where the CPU has it."""
    lib = native.library()
    return [0, 1] if lib.kernels_isa(1) and lib.rowq8_isa() else [0]


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("out, inner", SHAPES)
def test_rows_equal_the_reference_arithmetic_bit_for_bit(kind, out, inner):
    """Every window of m rows (1, the one-row and two-row tiles, past an 8-row tile) on 1 and 2 threads, in AVX2
    and (where the CPU has it) AVX-512 VNNI: exactly rowq8.reference's floats, so no row depends on its
    neighbours, the threads or the instruction set."""
    _, blocks = file_blocks(out, inner, out * 5 + inner, kind)
    packed = rowq8.pack(blocks, out, inner)
    assert packed.format == rowq8.FORMATS[kind][0]
    x = torch.randn(70, inner, generator=torch.Generator().manual_seed(out)) * 3
    x[5, : inner // 2] = 0   # a group of zeros: scale 0, no division by it
    x[6, :32] = -x[6, :32].abs()   # a group all negative: sum(qx) far from 0 (Q8_0's 128 * sum taken back)
    want = rowq8.reference(x, blocks)
    lib, before = native.library(), torch.get_num_threads()
    try:
        for isa in isas():
            lib.kernels_isa(isa)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for a, b in ((0, 1), (4, 5), (5, 6), (0, 2), (1, 4), (0, 8), (3, 12), (0, 70)):
                    assert torch.equal(rowdot.linear(x[a:b], packed), want[a:b]), f"rows {a}:{b}, isa {isa}, {threads} threads"
    finally:
        lib.kernels_isa(1)
        torch.set_num_threads(before)


def test_the_largest_integer_sums_stay_exact():
    """Every Q4_1 nibble 15 against inputs of +-127 (the most a group's int16 lanes hold before widening: 8 x 3,810
    on AVX2) and against a group that alternates them: the reference's exact integers on every path."""
    out, inner = 48, 96
    raw = np.zeros((out, inner // 32, 20), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)   # d
    raw[:, :, 2:4] = np.frombuffer(np.float16(-1.0).tobytes(), dtype=np.uint8)  # m
    raw[:, :, 4:] = 0xFF
    raw[1::2, 1, 4:] = 0x0F   # some columns' second group: low nibbles 15, high 0
    blocks = rowquant.Blocks("q4_1", torch.from_numpy(raw.reshape(out, -1)))
    x = torch.ones(6, inner) * 3.0
    x[1] = -3.0
    x[2, ::2] = -3.0
    x[3, :32] = 0
    x[4] = torch.arange(inner) % 7 - 3.0
    x[5, 1::2] = -3.0
    packed = rowq8.pack(blocks, out, inner)
    want = rowq8.reference(x, blocks)
    assert torch.equal(want[0, :1], torch.tensor([inner * (15 * 0.5 * 3.0 - 3.0)]))   # 15 * d * x + m * x
    lib = native.library()
    try:
        for isa in isas():
            lib.kernels_isa(isa)
            for a, b in ((0, 1), (1, 2), (0, 4), (0, 6)):
                assert torch.equal(rowdot.linear(x[a:b], packed), want[a:b]), (isa, a, b)
    finally:
        lib.kernels_isa(1)


@pytest.mark.parametrize("kind", TYPES)
def test_silu_rows_are_the_same_on_every_path(kind):
    _, blocks = file_blocks(200, 576, 3, kind)
    packed = rowq8.pack(blocks, 200, 576)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(2))
    lib = native.library()
    outs = []
    try:
        for isa in isas():
            lib.kernels_isa(isa)
            outs.append(torch.cat([rowdot.silu_linear(x[i:i + 1], packed) for i in range(11)]))
            outs.append(rowdot.silu_linear(x, packed))
    finally:
        lib.kernels_isa(1)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.allclose(outs[0], torch.nn.functional.silu(rowq8.reference(x, blocks)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", TYPES)
def test_close_to_float32_on_the_same_weight(kind):
    """The rounding of the inputs is the only difference from float32 on the converted weight: ~0.5% here."""
    weight, blocks = file_blocks(576, 1536, 1, kind)
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(4))
    exact = x @ weight.T
    got = rowdot.linear(x, rowq8.pack(blocks, 576, 1536))
    err = float((got - exact).norm() / exact.norm())
    assert 0 < err < 0.02


def test_quantize_rounds_half_to_even_and_keeps_zero_groups():
    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-1.0, 1.0, 32)
    q, d, s = rowq8.quantize(x)
    assert q[0, :32].abs().max() == 127 and torch.equal(q[0, 32:], torch.zeros(32, dtype=torch.int32))
    assert float(d[0, 1]) == 0 and float(s[0, 1]) == 0


def test_only_known_blocks_of_the_right_shape():
    _, blocks = file_blocks(40, 64, 0)
    with pytest.raises(ValueError):
        rowq8.pack(blocks, 40, 96)
    with pytest.raises(ValueError):
        rowq8.pack(rowquant.Blocks("q8_0", blocks.data), 40, 64)   # 20-byte blocks are not Q8_0's 34
    with pytest.raises(ValueError):
        rowq8.pack(rowquant.Blocks("q5_k", blocks.data), 40, 64)


@pytest.fixture(scope="module")
def folder():
    return resolve_model(smollm2.NAME)


def test_smollm2_q8_is_its_own_numerics_and_batch_invariant(folder):
    """The default model with q8 inputs: the rule and the served fingerprint say so; a request's logits do not
    change by a bit with its neighbours, its prompt chunking or the pipeline split; and they are q8's, not
    float32's (every projection and the tied head read their groups)."""
    full = load_slice(folder, inputs="q8")
    if full.rows.linear != "rowdot":
        pytest.skip(f"this machine serves {full.rows}: q8 needs rowdot")
    assert full.rows.inputs == "q8" and "q8 linear inputs" in full.rows.kernels
    tok = load_model_tokenizer(folder)
    ids = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    alone = run_chunks([full], ids, [len(ids)])
    assert torch.equal(run_chunks([full], ids, [5, 1, len(ids) - 6]), alone)
    slices = [load_slice(folder, a, b, inputs="q8") for a, b in even_split(full.cfg.num_hidden_layers, 2)]
    assert torch.equal(run_chunks(slices, ids, [7, len(ids) - 7]), alone)
    other = tok.encode("Once upon a time there was")
    kvs = [full.new_kv(), full.new_kv()]
    for kv, r in zip(kvs, (ids, other)):
        kv.ensure(len(r))
    both = full.logits(full(torch.tensor(ids + other), [SlotRows(kvs[0], 0, len(ids)), SlotRows(kvs[1], 0, len(other))]))
    assert torch.equal(both[:len(ids)], alone)
    exact = run_chunks([load_slice(folder)], ids, [len(ids)])
    assert not torch.equal(exact, alone)
    assert int(exact[-1].argmax()) == int(alone[-1].argmax())   # the same answer to this one, on other bits


def test_q8_inputs_refused_off_rowdot(folder):
    model = load_slice(folder, 29, 30)
    with pytest.raises(ValueError, match="q8"):
        model.use_inputs("bf16")
    if model.rows.linear == "rowdot":
        model.rows = dataclasses.replace(model.rows, linear="mkl")
    with pytest.raises(ValueError, match="rowdot"):
        model.use_inputs("q8")


def test_q8_on_a_folder_without_groups_says_its_linears_stay_float32(caplog):
    """`tiny` keeps no GGUF groups: q8 asked for changes no product, and the load says so instead of quietly
    naming numerics it does not compute."""
    with caplog.at_level("WARNING", logger="tether.model.llama"):
        model = load_slice(resolve_model("tiny"), inputs="float32")
        assert not caplog.records
        if model.rows.linear != "rowdot":
            pytest.skip(f"this machine serves {model.rows}: q8 needs rowdot")
        load_slice(resolve_model("tiny"), inputs="q8")
    assert any("keeps no GGUF groups" in r.getMessage() for r in caplog.records)
