"""The rowdot kernel (kernels/rowdot.c): fp32 linears whose every output is one multiply-add chain over k in
order, so a row's bits never depend on the row count, the tiling or the thread: batch-invariant with no padding.

Why our own: on an AMD EPYC without AVX-512 (AVX2, FMA) MKL's small-M sgemm is slow and its rows change
with M (padded to 4 rows a step), and oneDNN's fp32 rows agree only from 2 rows and cost more. rowdot reads
each weight once per call at any row count up to 64 (smollm2's 15 layers' linears at 1 row: see
docs/PERFORMANCE.md). It is compiled here, once per machine and source, with the C compiler the machine has
(`cc`, AVX2 and FMA required): where it cannot be built `available()` says why, and the numerics probe, which
decides whether a kernel serves, skips it (tether/model/numerics.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from tether.mathutil import ceil_div
from tether.model.presets import tether_home

SOURCE = Path(__file__).parent / "kernels" / "rowdot.c"
BLOCK = 16   # output columns per packed block (rowdot.c's BLOCK)
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared")
NEEDS = frozenset({"avx2", "fma"})   # /proc/cpuinfo flags the built code runs on


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] fp32 weight as rowdot reads it: [ceil(out / 16), in, 16], columns past `out` zero."""

    data: torch.Tensor
    out_features: int
    in_features: int


class Unavailable(RuntimeError):
    """rowdot cannot run here (no AVX2/FMA, no compiler, a failed build): the probe skips the kernel."""


def _cpu_has() -> bool:
    from tether.model.numerics import cpu_flags   # numerics imports the kernels
    return NEEDS <= cpu_flags()


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    """The compiled kernel, built into the tether home on first use (keyed by source and flags: an edit
    rebuilds), loaded once per process."""
    if not _cpu_has():
        raise Unavailable(f"the CPU lacks {', '.join(sorted(NEEDS))}")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise Unavailable("no C compiler (cc or gcc) to build it")
    source = SOURCE.read_bytes()
    digest = xxhash.xxh3_64_hexdigest(source + " ".join((cc, *FLAGS)).encode())
    folder = tether_home() / "kernels"
    path = folder / f"rowdot-{digest}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".rowdot-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise Unavailable(f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-500:]}")
            os.replace(tmp, path)   # atomic: processes building at once each install a whole library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rowdot_pack.argtypes = [ptr, i64, i64, ptr]
    lib.rowdot_pack.restype = None
    lib.rowdot.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64, ctypes.c_int]
    lib.rowdot.restype = None
    return lib


def available() -> str | None:
    """None where rowdot runs here, else why not."""
    try:
        _library()
    except (Unavailable, OSError) as e:
        return str(e)
    return None


def pack(weight: torch.Tensor) -> PackedWeight:
    """`weight` [out, in] (fp32) in rowdot's blocked layout, made once per weight."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise Unavailable(f"rowdot packs 2-d float32 weights, not {weight.dtype} {tuple(weight.shape)}")
    lib = _library()
    w = weight.detach().contiguous()
    n, k = w.shape
    out = torch.empty(ceil_div(n, BLOCK), k, BLOCK, dtype=torch.float32)
    lib.rowdot_pack(w.data_ptr(), n, k, out.data_ptr())
    return PackedWeight(out, n, k)


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) over the last dimension of `x`, on torch's thread count (split by output columns);
    every row's bits independent of the others and of the threads."""
    lib = _library()
    lead, k = x.shape[:-1], x.shape[-1]
    if k != weight.in_features or x.dtype != torch.float32:
        raise ValueError(f"rowdot: input [..., {k}] {x.dtype} against a weight of {weight.in_features} inputs")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], weight.out_features
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib.rowdot(rows.data_ptr(), rows.stride(0), weight.data.data_ptr(), k, y.data_ptr(), n, n, m,
                   torch.get_num_threads())
    if bias is not None:
        y += bias
    return y.view(*lead, n)


def silu_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ weight.T + bias): ATen's SiLU after the product (the probe sweeps its row counts)."""
    return torch.nn.functional.silu(linear(x, weight, bias))
