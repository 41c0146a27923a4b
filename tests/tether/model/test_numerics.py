"""`--dtype auto`: the rule alone (flags + probe -> dtype), its inputs, and the probe on the model's shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tether import settings
from tether.model import invariant, numerics
from tether.model.config import ModelConfig
from tether.model.invariant import RowRule
from tether.model import native
from tether.model.loader import resolve_model


def _probe(result: bool):
    calls = []

    def probe() -> bool:
        calls.append(1)
        return result
    return probe, calls


@pytest.mark.parametrize("flags,probe_ok,want,probed", [
    ({"avx512f", "avx512_bf16"}, True, "bfloat16", True),
    ({"amx_bf16", "amx_tile"}, True, "bfloat16", True),
    ({"fp", "asimd", "bf16"}, True, "bfloat16", True),          # aarch64 "Features"
    ({"avx512f", "avx512_bf16"}, False, "float32", True),       # native, but a kernel was not invariant
    ({"avx512f", "avx2"}, True, "float32", False),              # no native bf16: never probed
    (set(), True, "float32", False),
])
def test_choose_dtype(flags, probe_ok, want, probed):
    probe, calls = _probe(probe_ok)
    assert numerics.choose_dtype(frozenset(flags), probe) == want
    assert bool(calls) == probed


@pytest.mark.parametrize("flags", [{"avx512f", "avx512_bf16"}, {"avx2", "fma"}, set()])
def test_choose_dtype_prefers_fp32_on_our_whole_layer_kernels(flags):
    """Where our kernels run whole layers, fp32 is chosen before bf16 is probed at all; where they do not, the
    bf16 rule above decides."""
    probe, calls = _probe(True)
    assert numerics.choose_dtype(frozenset(flags), probe, lambda: True) == "float32"
    assert not calls
    want = "float32" if numerics.BF16_FLAGS.isdisjoint(flags) else "bfloat16"
    assert numerics.choose_dtype(frozenset(flags), probe, lambda: False) == want


def test_cpu_flags_reads_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: EPYC\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert numerics.cpu_flags(x86) == {"fpu", "avx512f", "avx512_bf16"}
    assert numerics.cpu_flags(arm) == {"fp", "asimd", "bf16", "i8mm"}
    assert numerics.cpu_flags(tmp_path / "absent") == frozenset()


def test_resolve_passes_explicit_dtypes_and_refuses_others():
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    assert numerics.resolve("float32", cfg) == "float32"
    assert numerics.resolve("bfloat16", cfg) == "bfloat16"
    assert numerics.resolve("auto", cfg) in ("float32", "bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of auto, float32"):
        numerics.resolve("int8", cfg)
    assert numerics.name_of(torch.bfloat16) == "bfloat16"


def test_the_probe_finds_unpadded_float32_variant_and_restores_threads():
    """fp32 MKL changes a row's bits with the row count (why fp32 is padded): the probe must see that, or it
    could not be trusted to pass bf16."""
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    before = torch.get_num_threads()
    assert numerics.probe_floors(cfg, torch.float32) is None
    assert torch.get_num_threads() == before


def test_the_probe_sees_a_row_that_differs_only_in_a_one_row_product():
    """What the first probe missed (smollm2's bf16 down_proj: a 1-row product gives ~10% of rows other bits,
    row 0 not among them): every window of rows is compared, not the first, so the floor becomes 2 rows."""
    x = torch.randn(max(numerics.PROBE_ROWS), 8)

    def op(rows: torch.Tensor) -> torch.Tensor:   # the bits of row 7 change when it is computed alone
        out = rows * 3
        if rows.shape[0] == 1 and torch.equal(rows, x[7:8]):
            out = torch.nextafter(out, out + 1)
        return out

    assert numerics._failing_rows(op, x, (1,)) == {1}
    assert numerics.floor_of({1}) == 2
    assert numerics._failing_rows(lambda r: r * 3, x, (1, 2)) == set()
    assert numerics.floor_of(set()) == 1


@pytest.mark.parametrize("failing, floor", [(set(), 1), ({1}, 2), ({1, 2}, 3), ({3}, 4), ({4}, None), ({1, 5}, None),
                                            ({48}, None)])
def test_the_floor_pads_past_every_failing_row_count_but_no_further_than_max_floor(failing, floor):
    assert numerics.floor_of(failing) == floor


def test_auto_is_probed_once_per_process(monkeypatch):
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    calls = []
    monkeypatch.setattr(numerics, "probe_floors", lambda c, dtype, **kw: calls.append(c) or (1, ()))
    monkeypatch.setattr(numerics, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setenv(settings.PROBE_CACHE_ENV, "0")   # this process's own probing (the disk: test_probe_cache)
    numerics._found.cache_clear()
    try:
        first = numerics.resolve("auto", cfg)   # fp32 where our kernels run whole layers, else bf16
        probed = len(calls)
        assert probed >= 1 and [numerics.resolve("auto", cfg) for _ in range(2)] == [first] * 2
        assert len(calls) == probed
    finally:
        numerics._found.cache_clear()   # later tests probe for real


def test_the_choice_is_made_on_one_thread_whatever_the_process_runs_on(monkeypatch):
    """Every process on a machine must choose the same kernels (a row's bits depend on them): a 2-thread
    process whose 2-thread products differ keeps the 1-thread choice, capped to 1 thread, instead of
    choosing other kernels (the reference and a stage would then disagree)."""
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    seen = []
    real = numerics._padded_checks

    def checks(c, dtype, unit, t, check=None):
        seen.append(t)   # the threads it is asked to check on
        return real(c, dtype, unit, t, check) if t == 1 else False
    monkeypatch.setattr(numerics, "_padded_checks", checks)
    monkeypatch.setattr(numerics, "probe_floors", lambda c, dtype, **kw: seen.append(torch.get_num_threads()) or None)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        choice = numerics.choose_rule(cfg, torch.float32)
        assert choice is not None and set(seen) == {1}
        assert numerics.with_thread_cap(cfg, torch.float32, choice) == dataclasses.replace(choice, threads=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_padded_probe_takes_the_smallest_unit_that_holds_here_and_restores_threads():
    """The unit is found, not assumed (4 on an AMD EPYC, 16 on an Intel Xeon): the rule holds on every op class,
    and where it is above the smallest unit, that smaller unit really changes some row's bits here."""
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    before = torch.get_num_threads()
    rule = numerics.padded_probe(cfg, torch.float32)
    assert torch.get_num_threads() == before
    assert rule is not None and rule.padded and rule.unit in numerics.UNITS
    assert numerics._padded_checks(cfg, torch.float32, rule.unit, 1)
    smaller = [u for u in numerics.UNITS if u < rule.unit]
    assert not any(numerics._padded_checks(cfg, torch.float32, u, 1) for u in smaller)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("holds_on, threads, cap", [({1, 2, 3, 4}, 4, None), ({1, 2}, 4, 2), ({1}, 2, 1)])
def test_the_thread_cap_is_the_most_threads_that_keep_one_thread_bits(monkeypatch, holds_on, threads, cap):
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    monkeypatch.setattr(numerics, "_padded_checks", lambda c, dtype, unit, t, check=None: unit == 16 and t in holds_on)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert numerics.padded_probe(cfg, torch.float32) == RowRule(16)
        assert numerics.with_thread_cap(cfg, torch.float32, RowRule(16)) == RowRule(16, threads=cap)
    finally:
        torch.set_num_threads(before)


def test_a_dtype_with_no_invariant_unit_is_refused_with_a_reason(monkeypatch):
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    monkeypatch.setattr(numerics, "_padded_checks", lambda *a: False)
    monkeypatch.setenv(settings.PROBE_CACHE_ENV, "0")
    numerics._found.cache_clear()
    try:
        assert numerics.padded_probe(cfg, torch.float16) is None
        assert numerics.servable_rule(cfg, torch.float16) is None
        with pytest.raises(ValueError, match="float16 has no batch-invariant kernels on this CPU.*--dtype auto"):
            numerics.row_rule(cfg, torch.float16)
    finally:
        numerics._found.cache_clear()


def test_the_padded_check_sees_a_row_that_differs_at_one_padded_count():
    x = torch.randn(64, 8)

    def op(rows: torch.Tensor) -> torch.Tensor:   # 32-row calls give other bits
        out = rows * 3
        return torch.nextafter(out, out + 1) if rows.shape[0] == 32 else out

    assert numerics._window_differs(op, x, op(x), [16, 32])
    assert not numerics._window_differs(op, x, op(x), [16, 48])


@pytest.mark.parametrize("fast, padded, want", [
    (RowRule(None, 2, linear="onednn", tile_unit=4), RowRule(16), "fast"),     # MKL pads past 4 rows: oneDNN
    (RowRule(None, 2, linear="onednn", tile_unit=4), RowRule(8), "fast"),
    (RowRule(None, 2, linear="onednn", tile_unit=4), RowRule(4), "padded"),    # 4 MKL rows beat 2 oneDNN ones
    (RowRule(None, 4, linear="onednn", tile_unit=4), RowRule(4), "padded"),
    (None, RowRule(16), "padded"),
    (RowRule(None, 2, linear="onednn", tile_unit=4), None, "fast"),
    (None, None, None),
])
def test_the_choice_keeps_mkl_padded_to_4_rows_else_takes_onednn(monkeypatch, fast, padded, want):
    """Where our own kernel does not serve (no AVX2, no compiler)."""
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    monkeypatch.setattr(numerics, "rowdot_probe", lambda c, dtype: None)
    monkeypatch.setattr(numerics, "onednn_probe", lambda c, dtype: fast)
    monkeypatch.setattr(numerics, "padded_probe", lambda c, dtype: padded)
    assert numerics.choose_rule(cfg, torch.float32) == {"fast": fast, "padded": padded, None: None}[want]


ROWDOT = RowRule(None, 1, linear="rowdot", tile_unit=4)


@pytest.mark.parametrize("own, want", [
    (ROWDOT, "own"),                                                             # pads nothing: taken first
    (dataclasses.replace(ROWDOT, floor=2), "padded"),                            # would pad: the usual choice
    (dataclasses.replace(ROWDOT, linear_floors=((1536, 576, 2),)), "padded"),
    (None, "padded"),
])
def test_the_choice_takes_rowdot_where_it_pads_nothing(monkeypatch, own, want):
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    padded = RowRule(4)
    monkeypatch.setattr(numerics, "rowdot_probe", lambda c, dtype: own)
    monkeypatch.setattr(numerics, "onednn_probe", lambda c, dtype: None)
    monkeypatch.setattr(numerics, "padded_probe", lambda c, dtype: padded)
    assert numerics.choose_rule(cfg, torch.float32) == {"own": own, "padded": padded}[want]


def test_rowdot_where_it_runs_is_invariant_from_one_row_on_its_own_checks():
    """Where rowdot builds (AVX2 and FMA, a C compiler), the probe finds it invariant from 1 row on every
    linear of the model: it is so by construction, and the probe is what says so, not the construction."""
    cfg = ModelConfig.from_folder(resolve_model("small"))
    why = native.available()
    rule = numerics.rowdot_probe(cfg, torch.float32)
    if why is not None:
        assert rule is None, why
        return
    assert rule is not None and (rule.floor, rule.linear_floors, rule.linear) == (1, (), "rowdot")
    assert (rule.attention, rule.tile_unit) == ("rowattn", None)   # our attention too: no tiles to pad
    assert rule.layers == "rowlayer"                                # and whole layers in one call
    assert numerics.choose_rule(cfg, torch.float32) == rule


def test_the_onednn_rule_it_finds_holds_on_its_own_checks():
    """Where oneDNN's fp32 linears are invariant unpadded here (smollm2 on an Intel Xeon), the rule's floor is
    what the unpadded probe returns with that kernel and its tile unit passes the tiles' check."""
    cfg = ModelConfig.from_folder(resolve_model("small"))
    rule = numerics.onednn_probe(cfg, torch.float32)
    floors = numerics._on_threads(1, lambda: numerics.probe_floors(cfg, torch.float32, kernel="onednn",
                                                                   attention=False))
    if rule is None:
        assert floors is None or not any(
            numerics._padded_checks(cfg, torch.float32, u, 1, numerics._tiles_hold) for u in numerics.UNITS)
        return
    assert rule.linear == "onednn" and not rule.padded and rule.tile_unit in numerics.UNITS
    assert floors is not None and (rule.floor, rule.linear_floors) == floors
    assert numerics._padded_checks(cfg, torch.float32, rule.tile_unit, 1, numerics._tiles_hold)
    assert rule.tiles() == RowRule(rule.tile_unit, threads=rule.threads)


@pytest.mark.parametrize("value, ok", [
    (None, True),
    ({"unit": 16, "floor": 1, "threads": None, "linear": "mkl", "tile_unit": None, "linear_floors": [], "attention": "tiles", "layers": "modules", "inputs": "float32"}, True),
    ({"unit": None, "floor": 2, "threads": 1, "linear": "onednn", "tile_unit": 4, "linear_floors": [[1536, 576, 2]], "attention": "tiles", "layers": "modules", "inputs": "float32"}, True),
    ({"unit": 5, "floor": 1, "threads": None, "linear": "mkl", "tile_unit": None, "linear_floors": [], "attention": "tiles", "layers": "modules", "inputs": "float32"}, False),
    ({"unit": None, "floor": 0, "threads": None, "linear": "mkl", "tile_unit": None, "linear_floors": [], "attention": "tiles", "layers": "modules", "inputs": "float32"}, False),
    ({"unit": None, "floor": 2, "threads": 0, "linear": "mkl", "tile_unit": None, "linear_floors": [], "attention": "tiles", "layers": "modules", "inputs": "float32"}, False),
    ({"unit": None, "floor": 2, "threads": None, "linear": "blas", "tile_unit": None, "linear_floors": [], "attention": "tiles", "layers": "modules", "inputs": "float32"}, False),
    ({"unit": None, "floor": 2, "threads": None, "linear": "onednn", "tile_unit": True, "linear_floors": [], "attention": "tiles", "layers": "modules", "inputs": "float32"}, False),
    ({"unit": 16, "floor": 1, "threads": None, "linear": "mkl"}, False),
    ({"unit": None, "floor": 1, "threads": None, "linear": "onednn", "tile_unit": None, "linear_floors": [[1536, 576, 9]], "attention": "tiles", "layers": "modules", "inputs": "float32"},
     False),
    ({"unit": None, "floor": 1, "threads": None, "linear": "onednn", "tile_unit": None, "linear_floors": [[1536, 576]], "attention": "tiles", "layers": "modules", "inputs": "float32"},
     False),
    ({"unit": None, "floor": 1, "threads": None, "linear": "onednn", "tile_unit": None, "linear_floors": "2", "attention": "tiles", "layers": "modules", "inputs": "float32"}, False),
    ({"unit": None, "floor": 1, "threads": None, "linear": "rowdot", "tile_unit": None, "linear_floors": [],
      "attention": "rowattn", "layers": "modules", "inputs": "float32"}, True),
    ({"unit": None, "floor": 1, "threads": None, "linear": "rowdot", "tile_unit": None, "linear_floors": [],
      "attention": "rowattn", "layers": "rowlayer", "inputs": "float32"}, True),
    ({"unit": None, "floor": 1, "threads": None, "linear": "rowdot", "tile_unit": None, "linear_floors": [],
      "attention": "flash", "layers": "modules", "inputs": "float32"}, False),
    ({"unit": None, "floor": 1, "threads": None, "linear": "rowdot", "tile_unit": None, "linear_floors": [],
      "attention": "rowattn", "layers": "graph", "inputs": "float32"}, False),
    # q8 inputs are asked for, never probed: not a rule on disk
    ({"unit": None, "floor": 1, "threads": None, "linear": "rowdot", "tile_unit": None, "linear_floors": [],
      "attention": "rowattn", "layers": "rowlayer", "inputs": "q8"}, False),
    # a rule kept before inputs was a field: probed again
    ({"unit": None, "floor": 1, "threads": None, "linear": "rowdot", "tile_unit": None, "linear_floors": [],
      "attention": "rowattn", "layers": "rowlayer"}, False),
    # a rule kept before layers was a field: probed again
    ({"unit": None, "floor": 1, "threads": None, "linear": "rowdot", "tile_unit": None, "linear_floors": [],
      "attention": "rowattn"}, False),
    # a rule kept before attention was a field: probed again
    ({"unit": 16, "floor": 1, "threads": None, "linear": "mkl", "tile_unit": None, "linear_floors": [],
      "layers": "modules", "inputs": "float32"}, False),
    ([16, None], False), ("16", False),
])
def test_a_rule_on_disk_is_checked_before_it_is_used(value, ok):
    assert numerics._is_rule(value) == ok


def test_a_kernel_that_cannot_run_here_is_not_chosen(monkeypatch):
    """A oneDNN build that cannot pack a dtype's weights raises: that kernel is skipped (bf16 tries F.linear
    next, fp32 keeps MKL), not the stage's start-up failed."""
    def refuse(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no packed layout for this dtype here")
    broken = dataclasses.replace(invariant.KERNELS["onednn"], prepare=refuse)
    monkeypatch.setitem(invariant.KERNELS, "onednn", broken)
    monkeypatch.setattr(numerics, "KERNELS", invariant.KERNELS)
    monkeypatch.setattr(numerics, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    assert numerics.onednn_probe(cfg, torch.float32) is None
    rule = numerics.choose_rule(cfg, torch.bfloat16)
    assert rule is None or rule.linear == "mkl"
