"""Batch-invariant kernels: a row's result never depends on the other rows of its micro-batch, on how its
request's prompt was chunked, or on the thread count.

What we found on torch 2.13 CPU (MKL sgemm, AVX-512; see docs/ARCHITECTURE.md "Batch invariance"):
- A GEMM row's bits depend on the row count M only through three classes: M = 1, M in {2, 3}, M >= 4.
  With T threads, MKL splits the rows among threads and a thread's share of 2-3 rows drops into the
  second class, so M in 5..7 and 9..11 broke with T = 2. Every M that is a multiple of 4*T agreed with
  every other such M and with 1-thread results, for every shape tried. Hence `padded_rows`.
- Vectorised elementwise ops (exp in silu and softmax) take a scalar path for a tensor's tail, whose
  results can differ by an ulp from the vector path. Padding rows to a multiple of 4*T keeps every
  tensor (and every thread's chunk of it) a multiple of the vector width when widths are multiples of 16.

- Since every multiple of 4*T rows on T threads has the 1-thread bits, a micro-batch needs no more threads
  than it has 4-row units: `invariant_threads` runs a batch of 1-4 rows on 1 thread padded to 4 rows, not on
  T threads padded to 4*T (the same bits for half the rows at T = 2, and no threads to wake).

- bf16 through oneDNN on a CPU with native bf16 (avx512_bf16, amx_bf16) needs almost none of this: its GEMM
  rows have the same bits for every row count >= 2 and thread count, but a 1-row product over K = 1536
  (smollm2's down_proj) gives ~10% of rows other bits. tether/model/numerics.py probes every window of rows at
  start-up on the model's own shapes and returns the floor to pad to (`padded_rows(..., pad=False, floor=2)`
  on smollm2: a decode step alone runs as 2 rows, every other batch on its own rows).

Attention, the one op that mixes rows, is in tether/model/tiles.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tether.mathutil import ceil_div

# torch's thread count is process-wide: while one invariant forward runs on fewer threads, another must not
# start (it would pad for the lowered count and run on the restored one).
_THREADS_LOCK = threading.Lock()


def padded_rows(rows: int, threads: int | None = None, pad: bool = True, floor: int = 1) -> int:
    """Row count that keeps every GEMM and elementwise op on one numeric path: a multiple of 4 * threads; or,
    where the kernels are invariant unpadded (`pad` False: tether/model/numerics.py), `rows` itself but at
    least `floor` (bf16 on smollm2: 2, as a 1-row product has other bits)."""
    if not pad:
        return max(rows, floor)
    unit = 4 * (threads or torch.get_num_threads())
    return max(unit, ceil_div(rows, unit) * unit)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def threads_for(rows: int, threads: int | None = None) -> int:
    """Threads worth using for `rows`: at most one per 4-row unit (every choice gives the same bits)."""
    return max(1, min(threads or torch.get_num_threads(), ceil_div(rows, 4)))


@contextmanager
def invariant_threads(rows: int) -> Iterator[int]:
    """Run an invariant forward of `rows` rows on `threads_for(rows)` threads, then restore the count. One
    invariant forward at a time per process, since the count is process-wide."""
    with _THREADS_LOCK:
        before = torch.get_num_threads()
        use = threads_for(rows, before)
        if use == before:
            yield use
            return
        torch.set_num_threads(use)
        try:
            yield use
        finally:
            torch.set_num_threads(before)
