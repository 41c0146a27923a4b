"""The numerics probe's answer kept on disk, per machine: every stage start and every `tether.reference` ran the
probe (seconds of CPU on the real model) to learn what the previous process on the same machine had learnt.

The key is everything the answer depends on: the code of the probe and of the ops it checks, torch's version, the CPU (model name and
feature flags), the model's shapes, the dtype and the thread count. A different machine, CPU or torch makes a
different key, so a stale answer is never read; a file that cannot be read or parsed is probed again.
TETHER_PROBE_CACHE=0 turns the cache off (the probe runs in every process, as before). The files are as
trusted as the model folders beside them in the same cache: whoever can write there can change the weights too.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any
from dataclasses import asdict
from pathlib import Path

import torch
import xxhash

from tether import settings
from tether.model.config import ModelConfig
from tether.model.presets import tether_home

def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first CPU's model name and feature flags (what kernel choices depend on); empty where unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    keep = [line for line in text.split("\n\n")[0].splitlines()
            if line.partition(":")[0].strip() in ("vendor_id", "model name", "flags", "Features", "CPU part")]
    return "\n".join(keep)


def key(code: str, cfg: ModelConfig, dtype: torch.dtype, threads: int, cpu: str | None = None) -> str:
    """The answer's key: `code` names the probe's code (numerics._code_digest), the rest what it ran on."""
    parts = {"code": code, "torch": torch.__version__, "cpu": cpu_identity() if cpu is None else cpu,
             "model": asdict(cfg), "dtype": str(dtype), "threads": threads}
    return xxhash.xxh3_128_hexdigest(json.dumps(parts, sort_keys=True, default=str).encode())


def enabled() -> bool:
    return os.environ.get(settings.PROBE_CACHE_ENV, "1") != "0"


def cached(k: str, compute: Callable[[], Any], valid: Callable[[object], bool], folder: Path | None = None) -> Any:
    """The answer stored under `k` (a JSON value that `valid` accepts), or `compute()`'s, stored (atomically)
    for the next process."""
    if not enabled():
        return compute()
    folder = folder or tether_home() / "probes"
    path = folder / f"{k}.json"
    try:
        value = json.loads(path.read_text())["answer"]
        if valid(value):
            return value
    except (OSError, ValueError, KeyError, TypeError):
        pass   # missing or unreadable: probe again
    value = compute()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".probe-")
        with os.fdopen(fd, "w") as f:
            json.dump({"answer": value}, f)
        os.replace(tmp, path)
    except OSError:
        pass   # a read-only home: the answer is still right, only not kept
    return value
