"""A slice's decoder layers in one call a step (kernels/rowlayer.c): RMSNorm, projections, RoPE, the KV store,
attention, residuals and the gated MLP, on rowdot's linears and rowattn's rows, the threads meeting at barriers
between a layer's phases. Every element is one fixed sequence of operations whatever the micro-batch and the
thread, so a row's bits are batch-invariant by construction; the numerics probe checks it before it serves
(`holds`, tether/model/numerics.py: RowRule.layers).

Why: through torch's modules a smollm2 decode step at 1 row spent about as long in ~40 small ATen ops a layer
and their Python as in the linears, and on 2 threads every linear forked and joined its own OpenMP team, so a
second core gained little (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tether.kv.paged import long_tensor
from tether.mathutil import ceil_div
from tether.model import native, rowattn, rowdot
from tether.model.tiles import Scratch

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class Shape(ctypes.Structure):
    """kernels/rowlayer.c's layer_shape."""

    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("inter", _i64),
                ("block", _i64), ("eps", _f32), ("scale", _f32)]


class Packed(ctypes.Structure):
    """kernels/rows.h's packed_weight: a projection's blocks and their format."""

    _fields_ = [("data", _ptr), ("format", _i64)]


class Weights(ctypes.Structure):
    """kernels/rowlayer.c's layer_weights: addresses of one layer's norm weights, its packed projections and
    biases."""

    _fields_ = [("ln1", _ptr), ("ln2", _ptr), *((name, Packed) for name in ("wq", "wk", "wv", "wo", "wg", "wu", "wd")),
                *((name, _ptr) for name in ("bq", "bk", "bv"))]


def supports(hidden: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Shapes the kernel takes: whole 8-float vectors per norm row and head, rowattn's head sizes."""
    return hidden % 8 == 0 and heads % kv_heads == 0 and rowattn.supports(head_dim) and head_dim % 2 == 0


@dataclass
class Layer:
    """One layer's weights as the kernel reads them: fp32 norm weights and packed projections (rowdot's fp32
    blocks or rowquant's)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    projections: tuple[rowdot.PackedWeight, ...]   # q, k, v, o, gate, up, down
    biases: tuple[torch.Tensor | None, ...] = (None, None, None)   # q, k, v (Qwen2's)

    def address(self) -> Weights:
        if any(b is not None and not (b.is_contiguous() and b.dtype == torch.float32) for b in self.biases):
            raise ValueError("rowlayer: biases must be contiguous float32")
        return Weights(self.ln1.data_ptr(), self.ln2.data_ptr(),
                       *(Packed(p.data.data_ptr(), p.format) for p in self.projections),
                       *(None if b is None else b.data_ptr() for b in self.biases))


class Stack:
    """A slice's layers (or a probe's) as one kernel call: holds the tensors whose addresses it passes."""

    def __init__(self, shape: Shape, layers: Sequence[Layer]) -> None:
        self.shape = shape
        self.layers = list(layers)
        self.weights = (Weights * len(self.layers))(*(layer.address() for layer in self.layers))

    def run(self, x: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
            cos: torch.Tensor, sin: torch.Tensor, write_rows: torch.Tensor, positions: torch.Tensor,
            first: torch.Tensor, tables: torch.Tensor, context: int, scratch: Scratch | None = None) -> torch.Tensor:
        """x [rows, hidden] (fp32, contiguous: updated in place and returned) through every layer on torch's
        thread count. keys/values: each layer's arena [blocks, kv_heads, block, d]; cos/sin: [rows, d] each row's
        rotary values; write_rows: [rows * kv_heads] flat arena rows of the new keys; row r at positions[r]
        reads the blocks tables[first[r]:]; context: the most positions a row reads."""
        lib = native.library()
        rows = x.shape[0]
        if not (x.is_contiguous() and x.dtype == torch.float32 and x.shape[1] == self.shape.hidden):
            raise ValueError(f"rowlayer: x must be contiguous float32 [rows, {self.shape.hidden}]")
        if len(keys) != len(self.layers) or len(values) != len(self.layers):
            raise ValueError("rowlayer: one arena per layer")
        s = self.shape
        arena = (s.kv_heads, s.block, s.head_dim)
        if any(t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape[1:]) != arena
               for t in (*keys, *values)):
            raise ValueError(f"rowlayer: each layer's keys and values must be contiguous float32 [blocks, {arena}]")
        if cos.shape != (rows, s.head_dim) or sin.shape != (rows, s.head_dim) or cos.dtype != torch.float32:
            raise ValueError(f"rowlayer: cos and sin must be float32 [rows, {s.head_dim}]")
        if write_rows.numel() != rows * self.shape.kv_heads or positions.numel() != rows or first.numel() != rows:
            raise ValueError("rowlayer: the plan's rows do not match x")
        threads = torch.get_num_threads()
        stride = ceil_div(context, 8) * 8

        def buffer(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return scratch.take(name, shape, torch.float32) if scratch is not None else torch.empty(shape)

        work = buffer("layer-work", (lib.rowlayer_work(ctypes.byref(self.shape), rows),))
        scores = buffer("row-scores", (threads, stride))
        cos, sin = cos.contiguous(), sin.contiguous()
        kp = (_ptr * len(keys))(*(k.data_ptr() for k in keys))
        vp = (_ptr * len(values))(*(v.data_ptr() for v in values))
        lib.rowlayers(ctypes.byref(self.shape), self.weights, len(self.layers), kp, vp, x.data_ptr(), rows,
                      cos.data_ptr(), sin.data_ptr(), write_rows.data_ptr(), positions.data_ptr(), first.data_ptr(),
                      tables.data_ptr(), work.data_ptr(), scores.data_ptr(), stride, threads)
        return x


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every row of x [rows, n] as the layers compute it (the final norm before the head)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    native.library().rownorm(x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, out.data_ptr())
    return out


def random_stack(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, block: int, layers: int,
                 g: torch.Generator) -> Stack:
    """Layers of random weights with these shapes (the probe's and the tests')."""
    def w(n: int, k: int) -> rowdot.PackedWeight:
        return rowdot.pack(torch.randn(n, k, generator=g) * k ** -0.5)
    made = [Layer(1 + 0.1 * torch.randn(hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g),
                  (w(heads * head_dim, hidden), w(kv_heads * head_dim, hidden), w(kv_heads * head_dim, hidden),
                   w(hidden, heads * head_dim), w(inter, hidden), w(inter, hidden), w(hidden, inter)))
            for _ in range(layers)]
    return Stack(Shape(hidden, heads, kv_heads, head_dim, inter, block, 1e-5, head_dim ** -0.5), made)


def holds(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, block: int,
          threads: tuple[int, ...]) -> bool:
    """The probe's check (tether/model/numerics.py), on the model's own shapes: three requests' rows (contexts
    up to 2.5 blocks, their blocks scattered in the arena) through two random layers all at once on 1 thread,
    then in windows of 1, 2, 3, 5, 17 and 48 rows in order (a decode row alone, chunked prefills), each window
    storing its keys for the next, on each thread count: the same bits, row for row."""
    if not supports(hidden, heads, kv_heads, head_dim):
        return False
    g = torch.Generator().manual_seed(13)
    stack = random_stack(hidden, inter, heads, kv_heads, head_dim, block, 2, g)
    reqs = rowattn.ProbeRequests.scattered(block, g)
    positions = reqs.positions
    # each row's keys go to its request's block at its position, every kv head: the arena's flat rows
    writes = [(reqs.tables[f + p // block] * kv_heads + h) * block + p % block
              for f, p in zip(reqs.first, positions) for h in range(kv_heads)]
    x = torch.randn(len(positions), hidden, generator=g)
    angles = torch.tensor(positions, dtype=torch.float32)[:, None] * torch.rand(head_dim // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    pos_t, first_t, tables_t, writes_t = (long_tensor(v) for v in (positions, reqs.first, reqs.tables, writes))
    context = reqs.context

    def arena() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([torch.zeros(reqs.arena_blocks, kv_heads, block, head_dim) for _ in range(2)],
                [torch.zeros(reqs.arena_blocks, kv_heads, block, head_dim) for _ in range(2)])

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        keys, values = arena()
        whole = stack.run(x.clone(), keys, values, cos, sin, writes_t, pos_t, first_t, tables_t, context)
        for t in threads:
            torch.set_num_threads(t)
            for m in (1, 2, 3, 5, 17, 48):
                keys, values = arena()
                for s in range(0, len(positions), m):
                    e = min(s + m, len(positions))
                    got = stack.run(x[s:e].clone(), keys, values, cos[s:e], sin[s:e],
                                    writes_t[s * kv_heads:e * kv_heads], pos_t[s:e], first_t[s:e], tables_t, context)
                    if not torch.equal(got, whole[s:e]):
                        return False
    finally:
        torch.set_num_threads(before)
    return True
