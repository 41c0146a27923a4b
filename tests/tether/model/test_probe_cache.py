"""The numerics probe's answer is kept per machine: a second process reads it instead of probing; a different
CPU, torch, model, dtype, thread count or probe code is a different key; a broken file is probed again."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from tether import settings
from tether.model import numerics, probe_cache
from tether.model.presets import PRESETS


def is_floor(value) -> bool:   # a validator like numerics' own, for these tests' answers
    return value is None or (type(value) is int and value >= 1)


def counting(value):
    calls = []

    def compute():
        calls.append(1)
        return value
    return compute, calls


@pytest.mark.parametrize("value", [None, 1, 2])
def test_an_answer_is_computed_once_then_read(tmp_path, value):
    compute, calls = counting(value)
    assert probe_cache.cached("k", compute, is_floor, tmp_path) == value
    assert probe_cache.cached("k", compute, is_floor, tmp_path) == value
    assert calls == [1]


@pytest.mark.parametrize("text", ["", "{", '{"answer": 0}', '{"answer": "2"}', '{"floor": 2}', '{"other": 1}', "[1]"])
def test_a_broken_file_is_probed_again_and_rewritten(tmp_path, text):
    (tmp_path / "k.json").write_text(text)
    compute, calls = counting(2)
    assert probe_cache.cached("k", compute, is_floor, tmp_path) == 2 and calls == [1]
    assert probe_cache.cached("k", compute, is_floor, tmp_path) == 2 and calls == [1]


def test_off_switch_probes_every_time(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.PROBE_CACHE_ENV, "0")
    compute, calls = counting(1)
    probe_cache.cached("k", compute, is_floor, tmp_path)
    probe_cache.cached("k", compute, is_floor, tmp_path)
    assert calls == [1, 1] and not list(tmp_path.iterdir())


def test_the_key_names_everything_the_answer_depends_on():
    cfg = PRESETS["tiny"]
    base = probe_cache.key("a", cfg, torch.bfloat16, 1, cpu="flags: avx512_bf16")
    others = [probe_cache.key("b", cfg, torch.bfloat16, 1, cpu="flags: avx512_bf16"),
              probe_cache.key("a", PRESETS["small"], torch.bfloat16, 1, cpu="flags: avx512_bf16"),
              probe_cache.key("a", dataclasses.replace(cfg, intermediate_size=cfg.intermediate_size + 16),
                              torch.bfloat16, 1, cpu="flags: avx512_bf16"),
              probe_cache.key("a", cfg, torch.float16, 1, cpu="flags: avx512_bf16"),
              probe_cache.key("a", cfg, torch.bfloat16, 2, cpu="flags: avx512_bf16"),
              probe_cache.key("a", cfg, torch.bfloat16, 1, cpu="flags: avx2")]
    assert len({base, *others}) == 1 + len(others)
    assert base == probe_cache.key("a", cfg, torch.bfloat16, 1, cpu="flags: avx512_bf16")


def test_a_second_process_reads_what_the_first_probed(tmp_path):
    """Across processes, as stages and the reference start: the second one's probe must not run."""
    code = ("import sys, torch\n"
            "from tether.model import numerics\n"
            "from tether.model.presets import PRESETS\n"
            "torch.set_num_threads(1)\n"
            "if sys.argv[1] == 'forbid':\n"
            "    numerics.probe = lambda *a, **k: sys.exit('probed again')\n"
            "print(numerics.unpadded_floor(PRESETS['tiny'], torch.bfloat16))\n")
    env = {**os.environ, settings.TETHER_HOME_ENV: str(tmp_path), settings.PROBE_CACHE_ENV: "1"}
    first = subprocess.run([sys.executable, "-c", code, "probe"], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    second = subprocess.run([sys.executable, "-c", code, "forbid"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    if not numerics.BF16_FLAGS.isdisjoint(numerics.cpu_flags()):   # elsewhere bf16 is never probed: no file
        assert len(list((tmp_path / "probes").glob("*.json"))) == 1


def test_the_probed_code_is_part_of_the_key(monkeypatch, tmp_path):
    """An edit to the probe or the ops it checks is a new key: copy the files, change one byte, and the digest moves."""
    import shutil
    from pathlib import Path
    here = Path(numerics.__file__).parent
    for name in numerics._PROBED_CODE:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(here / name, tmp_path / name)
    monkeypatch.setattr(numerics, "__file__", str(tmp_path / "numerics.py"))
    numerics._code_digest.cache_clear()
    try:
        same = numerics._code_digest()
        (tmp_path / "tiles.py").write_text((tmp_path / "tiles.py").read_text() + "\n# edited\n")
        numerics._code_digest.cache_clear()
        edited = numerics._code_digest()
        assert edited != same
        kernel = tmp_path / "kernels" / "rowdot.c"   # the C kernel's source too
        kernel.write_text(kernel.read_text() + "\n/* edited */\n")
        numerics._code_digest.cache_clear()
        assert numerics._code_digest() not in (same, edited)
    finally:
        numerics._code_digest.cache_clear()
