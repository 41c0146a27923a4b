"""Batch-invariant kernels: a row's result never depends on the other rows of its micro-batch, on how its
request's prompt was chunked, or on the thread count.

A GEMM row's bits depend on the row count M through the kernel paths the BLAS picks for M and the thread
count, and those paths differ between CPUs, so the rows a micro-batch is padded to are a `RowRule` the machine
finds at start-up (tether/model/numerics.py probes every op class on the model's own shapes):
- An AMD EPYC (torch 2.13, MKL sgemm, AVX-512): three classes, M = 1, M in {2, 3}, M >= 4; with T threads MKL
  splits the rows among them, so every multiple of 4*T rows has the 1-thread bits: unit 4.
- An Intel Xeon (the same torch and MKL, AVX-512 with AMX): every M < 16 has bits of its own and every
  M >= 16 shares one class at 1 thread (unit 16); on 2 threads MKL splits 1536->576 and 1376->512 products
  another way for some M (64-192, below 173), so that model's forward keeps to 1 thread (`RowRule.threads`).
- Vectorised elementwise ops (exp in silu and softmax) take a scalar path for a tensor's tail, whose results
  can differ by an ulp from the vector path. Rows padded to a multiple of unit*T keep every tensor (and every
  thread's chunk of it) a multiple of the vector width when widths are multiples of 16; unpadded rules (oneDNN
  fp32) fuse the SiLU into the gate's matmul (`Kernel.gate`), and the probe sweeps silu's row counts.
- Since every padded row count on T threads has the 1-thread bits, a micro-batch needs no more threads than
  it has units of rows: `invariant_threads` runs a batch of 1-4 rows (unit 4) on 1 thread padded to 4 rows,
  not on T threads padded to 4*T (the same bits for half the rows at T = 2, and no threads to wake).
- bf16 through oneDNN on a CPU with native bf16 (the EPYC's avx512_bf16) needed almost none of this: its GEMM
  rows had the same bits for every row count >= 2 and thread count, but a 1-row product over K = 1536
  (smollm2's down_proj) gave ~10% of rows other bits: an unpadded rule whose down_proj pads its own product
  to 2 rows (`RowRule.linear_floors`; every other op, and every batch of 2 rows or more, on its own rows).
  On the Xeon (AMX) bf16 rows change
  with M up to 36, so there bf16 is padded too and `auto` picks fp32.

Attention, the one op that mixes rows, is in tether/model/tiles.py.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tether.mathutil import ceil_div
from tether.model import rowdot

# torch's thread count is process-wide: while one invariant forward runs on fewer threads, another must not
# start (it would pad for the lowered count and run on the restored one).
_THREADS_LOCK = threading.Lock()


@dataclass(frozen=True)
class RowRule:
    """The rows a micro-batch runs on so that every kernel gives each row the same bits (found per machine,
    tether/model/numerics.py). `unit`: rows per thread, padded to a multiple of unit * threads; None: unpadded,
    at least `floor` rows. `threads`: the most threads a forward may use (None: any)."""

    unit: int | None = 4
    floor: int = 1
    threads: int | None = None
    # The linears' kernel (KERNELS), and, where the micro-batch runs unpadded on a kernel that is
    # invariant so but the tiles' batched matmuls are not, the unit their heights pad to (None: as the batch).
    linear: str = "mkl"
    tile_unit: int | None = None
    # (in_features, out_features, rows): linears of that shape that run on at least that many rows, above
    # `floor` (each pads its own input): on an AMD EPYC with avx512_bf16 only smollm2's down_proj (K = 1536)
    # gives a 1-row product other bits, so a decode step runs on 1 row and that one product on 2.
    linear_floors: tuple[tuple[int, int, int], ...] = ()
    # Attention's kernel: "tiles" (tether/model/tiles.py, batched ATen ops over (tile, key block) pairs) or
    # "rowattn" (tether/model/rowattn.py, our C kernel, one row at a time in a fixed order: no tiles to pad).
    attention: str = "tiles"
    # How a layer runs: "modules" (torch's modules above, op by op, on the kernels named here) or "rowlayer"
    # (tether/model/rowlayer.py: a step's layers in one C call, on rowdot and rowattn; its own norm and RoPE).
    layers: str = "modules"
    # What a linear multiplies: "float32" (its inputs as they are) or "q8" (tether/model/rowq8.py: inputs rounded
    # to 8 bits per group against a GGUF file's Q4_1 / Q8_0 groups, llama.cpp's arithmetic; asked for, never probed).
    inputs: str = "float32"

    def __post_init__(self) -> None:   # a rule read back from JSON has lists: one spelling, one str()
        object.__setattr__(self, "linear_floors", tuple(sorted(tuple(f) for f in self.linear_floors)))

    @property
    def padded(self) -> bool:
        return self.unit is not None

    def linear_floor(self, inner: int, outer: int) -> int:
        """The fewest rows a linear of this shape runs on (1: as many as the micro-batch has)."""
        return next((rows for i, o, rows in self.linear_floors if (i, o) == (inner, outer)), 1)

    def tiles(self) -> RowRule:
        """How attention tile heights pad (an unpadded rule's floor is for GEMM rows, not tiles)."""
        if self.tile_unit is not None:
            return RowRule(self.tile_unit, threads=self.threads)
        return self if self.padded else RowRule(None, threads=self.threads)

    @property
    def kernels(self) -> str:
        """What decides a row's bits (the handshake compares it along a route): the rule without its thread
        cap, which only keeps a forward to threads that give the 1-thread bits."""
        return str(dataclasses.replace(self, threads=None))

    def __str__(self) -> str:
        rows = f"padded to {self.unit} rows per thread" if self.unit else f"unpadded, at least {self.floor} rows"
        if self.linear != "mkl":
            rows += f", {self.linear} linears"
        if self.tile_unit is not None:
            rows += f", tiles padded to {self.tile_unit} rows per thread"
        for i, o, n in self.linear_floors:
            rows += f", {i}->{o} products on at least {n} rows"
        if self.attention != "tiles":
            rows += f", {self.attention} attention"
        if self.layers != "modules":
            rows += f", {self.layers} layers"
        if self.inputs != "float32":
            rows += f", {self.inputs} linear inputs"
        return rows if self.threads is None else f"{rows}, at most {self.threads} thread(s)"


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered once into oneDNN's blocked layout (an opaque mkldnn tensor). Unpacked, oneDNN
    reorders the weight on every call: on an AMD EPYC with avx512_bf16, smollm2's 15 layers' bf16 linears
    took 19 ms a 2-row step through F.linear and 11 ms packed, with the same bits."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias through oneDNN's matmul on a packed weight (`onednn_pack`), rather than MKL's sgemm
    (what F.linear takes for fp32): on an Intel Xeon its fp32 rows have the same bits for every row count >= 2
    and thread count, where MKL's change below 16 rows (tether/model/numerics.py probes it before a slice uses
    it)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_silu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ weight.T + bias), the SiLU fused into oneDNN's matmul ("swish"): its eltwise runs the same vector code
    on every element. ATen's own silu takes a scalar path for the tail of a tensor, and of each thread's chunk
    of it, whose exp differs by an ulp: on an AMD EPYC without AVX-512, tiny's [M, 688] silu on 2 threads gave
    odd M >= 55 other bits, where the oneDNN rule runs M unpadded."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "swish", [], "")


def mkl_silu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ weight.T + bias) as torch computes it: invariant where rows pad to whole vectors (numerics
    probes it)."""
    return torch.nn.functional.silu(torch.nn.functional.linear(x, weight, bias))


def _as_is(weight: torch.Tensor) -> torch.Tensor:
    return weight


@dataclass(frozen=True)
class Kernel:
    """The linears' kernel a RowRule names: the product, the MLP's gate projection with its SiLU, and what a
    weight becomes once before either runs on it (the probe checks the kernel exactly so). `fused_silu`: the
    gate's SiLU runs inside the product; otherwise ATen's SiLU follows it, whose row counts the probe sweeps."""

    linear: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]
    gate: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]
    prepare: Callable[[torch.Tensor], Any]
    fused_silu: bool = False


# "mkl": torch's own F.linear (MKL's sgemm for fp32, oneDNN reordering the weight per call for bf16); "rowdot":
# our fp32 kernel whose rows are invariant by construction (tether/model/rowdot.py; where it cannot be built,
# its prepare raises and the probe skips it)
KERNELS = {"mkl": Kernel(torch.nn.functional.linear, mkl_silu_linear, _as_is),
           "onednn": Kernel(onednn_linear, onednn_silu_linear, onednn_pack, fused_silu=True),
           "rowdot": Kernel(rowdot.linear, rowdot.silu_linear, rowdot.pack, fused_silu=True)}


def padded_rows(rows: int, rule: RowRule, threads: int | None = None) -> int:
    """Row count that keeps every GEMM and elementwise op on one numeric path by `rule`: a multiple of
    unit * threads (at least one), or, unpadded, `rows` itself but at least the rule's floor."""
    if rule.unit is None:
        return max(rows, rule.floor)
    unit = rule.unit * (threads or torch.get_num_threads())
    return max(unit, ceil_div(rows, unit) * unit)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def threads_for(rows: int, rule: RowRule, threads: int | None = None, wide: int = 0) -> int:
    """Threads worth using for `rows`: at most one per unit of rows (4 where unpadded), or, `wide` > 0 (the only
    micro-batch in the pipeline, whose other stages' cores are idle), that many whatever the rows; at most the
    rule's cap either way (every choice gives the same bits). Alone, even one row gains: smollm2's bf16 step at
    1 row took 33 ms on 2 threads against 38 on 1 on an AMD EPYC, its linears bound by one core's memory
    bandwidth."""
    most = wide or threads or torch.get_num_threads()
    if rule.threads is not None:
        most = min(most, rule.threads)
    if wide:
        return max(1, most)
    return max(1, min(most, ceil_div(rows, rule.unit or 4)))


@contextmanager
def invariant_threads(rows: int, rule: RowRule, wide: int = 0) -> Iterator[int]:
    """Run an invariant forward of `rows` rows on `threads_for(rows, rule, wide=wide)` threads, then restore the
    count. One invariant forward at a time per process, since the count is process-wide."""
    with _THREADS_LOCK:
        use = threads_for(rows, rule, torch.get_num_threads(), wide)
        with _set_threads(use):
            yield use


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch's ops on one thread, then restore the count: for arithmetic whose bits must not follow the
    process's thread count (sampling: tether/generation/sampler.py). Inside another `one_thread` it is a no-op;
    never inside `invariant_threads` on the same thread (the count is then not one, and the lock not re-entrant)."""
    if torch.get_num_threads() == 1:
        yield
        return
    with _THREADS_LOCK, _set_threads(1):
        yield


@contextmanager
def _set_threads(use: int) -> Iterator[None]:
    before = torch.get_num_threads()
    if use == before:
        yield
        return
    torch.set_num_threads(use)
    try:
        yield
    finally:
        torch.set_num_threads(before)
