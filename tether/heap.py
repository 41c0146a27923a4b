"""The C heap of a service process: freed memory kept for the next step instead of returned to the kernel.

Why: a stage step allocates and frees the same few-MiB tensors every step (a micro-batch's logits, their float64
copies in sampling, activations). glibc returns such blocks to the kernel when freed (mmap'd above its dynamic
threshold, or trimmed off the top of the heap), so the next step page-faults them in again: on the AMD EPYC with
avx512_bf16, sampling 8 rows of smollm2's 49,152 logits took 3-4 ms that way and 0.8 ms with the memory kept
(docs/PERFORMANCE.md). Fixed thresholds keep blocks up to MMAP_THRESHOLD in the heap and leave up to
TRIM_THRESHOLD free at its top: RSS holds the steps' working set, as a pool would, and stays flat under load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

MMAP_THRESHOLD = 64 << 20   # bytes: larger blocks are still mmap'd (and unmapped when freed)
TRIM_THRESHOLD = 128 << 20  # bytes free at the heap's top before glibc gives any back
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt's parameters (malloc.h)


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Set this process's glibc heap thresholds (once); False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
