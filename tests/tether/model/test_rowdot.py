"""rowdot (tether/model/rowdot.py, kernels/rowdot.c): the product it computes, and a row's bits whatever rows
share its call. Skipped where it cannot be built (no AVX2/FMA or no C compiler); the numerics probe then never
chooses it (test_numerics.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tether.model import native, rowdot

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"our kernels do not run here: {native.available()}")

# (in, out): smollm2's and tiny's linears, and shapes whose columns end mid-block or whose K is odd
SHAPES = [(576, 576), (576, 192), (1536, 576), (576, 1536), (688, 256), (256, 688), (100, 37), (33, 17), (7, 1)]


@pytest.mark.parametrize("inner, outer", SHAPES)
def test_it_computes_the_product(inner, outer):
    g = torch.Generator().manual_seed(inner * 1000 + outer)
    w, x, b = torch.randn(outer, inner, generator=g), torch.randn(45, inner, generator=g), torch.randn(outer, generator=g)
    want = (x.double() @ w.double().T + b.double()).float()
    got = rowdot.linear(x, rowdot.pack(w), b)
    assert got.shape == (45, outer)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * inner ** 0.5)


@pytest.mark.parametrize("inner, outer", SHAPES)
def test_a_row_has_the_same_bits_in_every_call(inner, outer):
    """Every window of m rows of a 150-row batch (m = 1-13, past a 6-row tile and a 64-row chunk) and every
    permutation of rows gives each row the bits it has in the whole batch."""
    g = torch.Generator().manual_seed(inner + outer)
    p = rowdot.pack(torch.randn(outer, inner, generator=g))
    x = torch.randn(150, inner, generator=g)
    whole = rowdot.linear(x, p)
    for m in [*range(1, 14), 63, 64, 65, 100, 128]:
        for s in range(0, 150 - m + 1, m):
            assert torch.equal(rowdot.linear(x[s:s + m], p), whole[s:s + m]), f"{m} rows from {s}"
    order = torch.randperm(150, generator=g)
    assert torch.equal(rowdot.linear(x[order], p), whole[order])


def test_it_takes_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(3)
    p = rowdot.pack(torch.randn(48, 32, generator=g))
    x = torch.randn(5, 64, generator=g)[:, ::2]            # rows strided, columns strided
    want = rowdot.linear(x.contiguous(), p)
    assert torch.equal(rowdot.linear(x, p), want)
    assert torch.equal(rowdot.linear(x.reshape(5, 1, 32), p), want.view(5, 1, 48))
    assert rowdot.linear(torch.empty(0, 32), p).shape == (0, 48)


def test_its_gate_is_silu_of_the_product_fused():
    """The SiLU runs in the kernel, on every element alike: within 2 ulp-ish of ATen's, and a row's bits the same
    at every row count and thread count (ATen's own SiLU over [M, 688] was not, on 2 threads)."""
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(688, 256, generator=g) / 16, torch.randn(160, 256, generator=g) * 3
    p = rowdot.pack(w)
    got = rowdot.silu_linear(x, p)
    assert torch.allclose(got, F.silu(rowdot.linear(x, p)), rtol=1e-6, atol=1e-6)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 3, 55, 57, 99, 129):
                assert torch.equal(rowdot.silu_linear(x[:m], p), got[:m]), f"{m} rows on {threads} threads"
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="no bias"):
        rowdot.silu_linear(x, p, torch.zeros(688))


def test_it_refuses_what_it_cannot_compute():
    with pytest.raises(native.Unavailable, match="float32"):
        rowdot.pack(torch.zeros(4, 4, dtype=torch.bfloat16))
    p = rowdot.pack(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="8 inputs"):
        rowdot.linear(torch.zeros(2, 6), p)


def test_without_a_compiler_it_is_unavailable_and_says_why(monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    native.library.cache_clear()
    try:
        assert "failed to build" in (native.available() or "")
        with pytest.raises(native.Unavailable):
            rowdot.pack(torch.zeros(4, 4))
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.available() is None


@pytest.mark.parametrize("inner, outer", [(576, 1536), (1536, 576), (256, 688), (100, 37)])
def test_a_row_has_the_same_bits_on_every_thread_count(inner, outer):
    """The columns are split among torch's threads: 1-4 threads, at row counts that take each tile."""
    g = torch.Generator().manual_seed(inner * 7 + outer)
    p = rowdot.pack(torch.randn(outer, inner, generator=g))
    x = torch.randn(70, inner, generator=g)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = rowdot.linear(x, p)
        for threads in (2, 3, 4):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 6, 7, 70):
                assert torch.equal(rowdot.linear(x[:m], p), want[:m]), f"{m} rows on {threads} threads"
    finally:
        torch.set_num_threads(before)


def test_turned_off_they_are_unavailable_and_the_probe_chooses_without_them(monkeypatch):
    from tether import settings
    from tether.model import numerics
    from tether.model.config import ModelConfig
    from tether.model.loader import resolve_model
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    monkeypatch.setenv(settings.NATIVE_KERNELS_ENV, "0")
    native.library.cache_clear()
    numerics._found.cache_clear()
    try:
        assert "turned off" in (native.available() or "")
        rule = numerics.servable_rule(cfg, torch.float32)   # not the cached answer that names rowdot
        assert rule is not None and rule.linear != "rowdot" and rule.attention == "tiles"
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
        numerics._found.cache_clear()
    assert numerics.servable_rule(cfg, torch.float32).linear == "rowdot"


def test_kept_to_avx2_by_the_environment_and_a_wrong_value_refused(monkeypatch):
    """TETHER_KERNELS_ISA=avx2 (an AVX2-only CPU's kernels measured on this one) turns every AVX-512 path off and
    says so; native gives back what cpuid finds; anything else is refused with the values it takes."""
    from tether import settings
    native.library.cache_clear()
    has512 = native.library().kernels_isa(1)
    try:
        monkeypatch.setenv(settings.KERNELS_ISA_ENV, "avx2")
        native.library.cache_clear()
        lib = native.library()
        assert lib.kernels_isa(-1) == 0 and lib.rowq8_isa() == 0
        assert "AVX-512 off" in native.describe()
        monkeypatch.setenv(settings.KERNELS_ISA_ENV, "avx512")
        native.library.cache_clear()
        with pytest.raises(ValueError, match="avx2"):
            native.library()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
    assert native.library().kernels_isa(-1) == has512 and "AVX-512 off" not in native.describe()


@pytest.mark.parametrize("inner, outer", [(576, 576), (1536, 576), (100, 37), (33, 17)])
def test_the_avx512_tiles_give_the_avx2_bits(inner, outer):
    """Where the CPU has AVX-512, rows past one run on its tiles (up to 12 rows on two blocks at once, in tiles of
    even sizes; an odd block's rows 12 at a time): every window of rows gets the AVX2 tiles' bits (forced here),
    silu fused or not."""
    lib = native.library()
    if not lib.kernels_isa(1):
        pytest.skip("no AVX-512 (F, BW, DQ, VL) here: the AVX2 tiles only")
    g = torch.Generator().manual_seed(inner * 3 + outer)
    p = rowdot.pack(torch.randn(outer, inner, generator=g))
    x = torch.randn(150, inner, generator=g)
    windows = [*range(1, 15), 24, 63, 64, 65, 150]
    try:
        wide = [(rowdot.linear(x[:m], p), rowdot.silu_linear(x[:m], p)) for m in windows]
        lib.kernels_isa(0)
        narrow = [(rowdot.linear(x[:m], p), rowdot.silu_linear(x[:m], p)) for m in windows]
    finally:
        lib.kernels_isa(1)
    for m, (a, b) in zip(windows, zip(wide, narrow)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"{m} rows"
