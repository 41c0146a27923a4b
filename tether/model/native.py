"""Our C kernels (tether/model/kernels/*.c: rowdot, rowquant, rowq8, rowattn, rowlayer; nucleus, argmax and topk for
sampling), compiled on the machine that serves, once per source and flags, into the tether home, with the C compiler
the machine has (`$CC`, `cc` or `gcc`), and loaded once per process. They need AVX2, FMA and F16C; where they cannot
be built (another CPU, no compiler, a failed build) `available()` says why, and the numerics probe, which decides
what serves, chooses other kernels (and sampling its torch path).
TETHER_NATIVE_KERNELS=0 turns them off (a side-by-side measurement, or a machine where they misbehave).

OpenMP in them is torch's own libgomp (torch is imported first, and its libgomp.so.1 has the soname a built
library asks for), so their threads are the pool torch's ops use on the calling thread.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp is the one the library binds to)
import xxhash

from tether import settings
from tether.model.presets import tether_home

KERNELS = Path(__file__).parent / "kernels"
SOURCES = (KERNELS / "rowdot.c", KERNELS / "rowdot512.c", KERNELS / "rowquant.c", KERNELS / "rowq8.c",
           KERNELS / "rowattn.c", KERNELS / "rowlayer.c", KERNELS / "nucleus.c", KERNELS / "argmax.c",
           KERNELS / "topk.c")
HEADERS = (KERNELS / "vecmath.h", KERNELS / "rows.h")   # included by the sources: part of the build's key
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared")
NEEDS = frozenset({"avx2", "fma", "f16c"})   # /proc/cpuinfo flags the built code runs on


class Unavailable(RuntimeError):
    """The kernels cannot run here (no AVX2/FMA/F16C, no compiler, a failed build): the probe skips them."""


def _cpu_has() -> bool:
    from tether.model.numerics import cpu_flags   # numerics imports the kernels
    return NEEDS <= cpu_flags()


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The compiled kernels, built into the tether home on first use (keyed by sources, compiler and flags: an
    edit rebuilds), loaded once per process."""
    if os.environ.get(settings.NATIVE_KERNELS_ENV) == "0":
        raise Unavailable(f"turned off ({settings.NATIVE_KERNELS_ENV}=0)")
    isa = os.environ.get(settings.KERNELS_ISA_ENV, "native")
    if isa not in settings.KERNELS_ISAS:   # a setting's mistake, not a machine without the kernels: said, not skipped
        raise ValueError(f"{settings.KERNELS_ISA_ENV}={isa!r}: say avx2 (keep to AVX2) or native (what the CPU has)")
    if not _cpu_has():
        raise Unavailable(f"the CPU lacks {', '.join(sorted(NEEDS))}")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise Unavailable("no C compiler (cc or gcc) to build them")
    digest = xxhash.xxh3_64_hexdigest(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + " ".join((cc, *FLAGS)).encode())
    folder = tether_home() / "kernels"
    path = folder / f"tether-kernels-{digest}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kernels-", suffix=".so")
        os.close(fd)
        try:
            done = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode != 0:
                raise Unavailable(f"{cc} failed to build {', '.join(p.name for p in SOURCES)}: "
                                  f"{done.stderr.strip()[-500:]}")
            os.replace(tmp, path)   # atomic: processes building at once each install a whole library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.rowdot_pack.argtypes = [ptr, i64, i64, ptr]
    lib.rowdot_pack.restype = None
    lib.rowdot.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, i32, i32]
    lib.rowdot.restype = None
    lib.rowquant_bytes.argtypes = [i64, i64, i64]
    lib.rowquant_bytes.restype = i64
    lib.rowquant_pack.argtypes = [ptr, i64, i64, i64, ptr]
    lib.rowquant_pack.restype = None
    lib.rowquant_dequant.argtypes = [ptr, i64, i64, i64, ptr]
    lib.rowquant_dequant.restype = None
    lib.rowq8_bytes.argtypes = [i64, i64, i64]
    lib.rowq8_bytes.restype = i64
    lib.rowq8_pack.argtypes = [ptr, i64, i64, i64, ptr]
    lib.rowq8_pack.restype = None
    lib.rowq8_isa.argtypes = []
    lib.rowq8_isa.restype = i32
    lib.kernels_isa.argtypes = [i32]
    lib.kernels_isa.restype = i32
    lib.rowattn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, i64, ptr, i32]
    lib.rowattn.restype = None
    lib.rowlayer_work.argtypes = [ptr, i64]
    lib.rowlayer_work.restype = i64
    lib.rownorm.argtypes = [ptr, ptr, i64, i64, f32, ptr]
    lib.rownorm.restype = None
    lib.rowlayers.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32]
    lib.rowlayers.restype = None
    lib.nucleus_keep.argtypes = [ptr, i64, ctypes.c_double, ptr]
    lib.nucleus_keep.restype = i64
    lib.rows_argmax.argtypes = [ptr, i64, i64, ptr, i64, ptr]
    lib.rows_argmax.restype = None
    lib.temper_top_k.argtypes = [ptr, i64, ctypes.c_double, i64, ptr, ptr]
    lib.temper_top_k.restype = i64
    lib.kernels_isa(0 if isa == "avx2" else 1)   # 1: AVX-512 where cpuid has it (set either way: one library a process)
    return lib


def describe() -> str:
    """What the kernels run on here, for reports: built (and which instructions) or why not."""
    why = available()
    if why is not None:
        return f"not used ({why})"
    lib = library()
    wide, vnni = lib.kernels_isa(-1), lib.rowq8_isa()
    capped = os.environ.get(settings.KERNELS_ISA_ENV) == "avx2"
    return "built (AVX2, FMA, F16C" + ("; AVX-512 tiles" + ("; q8 in VNNI" if vnni else "") if wide else "") + \
        (f"; AVX-512 off: {settings.KERNELS_ISA_ENV}=avx2)" if capped else ")")


def available() -> str | None:
    """None where the kernels run here, else why not."""
    try:
        library()
    except (Unavailable, OSError) as e:
        return str(e)
    return None
