"""`--dtype auto`: the rule alone (flags + probe -> dtype), its inputs, and the probe on the model's shapes."""

from __future__ import annotations

import pytest
import torch

from tether.model import numerics
from tether.model.config import ModelConfig
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
    assert numerics.probe(cfg, torch.float32) is False
    assert torch.get_num_threads() == before


def test_auto_is_probed_once_per_process(monkeypatch):
    cfg = ModelConfig.from_folder(resolve_model("tiny"))
    calls = []
    monkeypatch.setattr(numerics, "probe", lambda c, dtype: calls.append(c) or True)
    monkeypatch.setattr(numerics, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    numerics._probed.cache_clear()
    try:
        assert [numerics.resolve("auto", cfg) for _ in range(3)] == ["bfloat16"] * 3
        assert calls == [cfg]
    finally:
        numerics._probed.cache_clear()   # later tests probe for real
