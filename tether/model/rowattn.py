"""Attention one query row at a time (kernels/rowattn.c) over the paged KV arena: every row's scores, softmax
and weighted sum in one fixed order whatever the micro-batch, so it needs no tiles and no padding. The rule
that serves rowdot linears serves this attention with them (RowRule.attention, chosen by the probe,
tether/model/numerics.py); the tiles (tether/model/tiles.py) serve every other rule.

Why: a decode step's tiles are ~20 small ATen ops a layer (index_select, bmm, scatter, exp, index_add, ...),
about 0.7 ms a layer at 1 row on an AMD EPYC without AVX-512, a quarter of a smollm2 step; one call here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tether.kv.paged import BlockArena, long_tensor
from tether.mathutil import ceil_div
from tether.model import native
from tether.model.tiles import Scratch, new_key_rows

MAX_HEAD_DIM = 256   # the kernel keeps a row's output in 32 vectors of 8


def supports(head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM


@dataclass
class RowAttentionPlan:
    """What a micro-batch's attention needs besides q/k/v, built once per step and used by every layer: each
    row's position and its request's block table, checked against the arena's owner tags."""

    arena: BlockArena
    scratch: Scratch
    rows: int                  # real rows (the micro-batch may be padded past them: those read row 0's keys)
    write_rows: torch.Tensor   # [rows * kv_heads] rows of the arena's flat K/V for the new keys
    positions: torch.Tensor    # [padded rows] each row's position
    first: torch.Tensor        # [padded rows] where each row's block table starts in `tables`
    tables: torch.Tensor       # the slots' block tables, one after the other
    context: int               # the longest row's context (positions it reads)

    @classmethod
    def build(cls, slots, padded: int, heads: int, kv_heads: int, scratch: Scratch) -> "RowAttentionPlan":
        """`slots`: SlotRows whose PagedKV blocks cover their rows (`ensure`)."""
        arena = slots[0].kv.arena
        if not supports(arena.head_dim) or heads % kv_heads or arena.dtype != torch.float32:
            raise ValueError(f"rowattn needs float32, head_dim a multiple of 8 up to {MAX_HEAD_DIM} and whole "
                             f"query groups; got {arena.dtype}, head_dim {arena.head_dim}, {heads}/{kv_heads} heads")
        write_rows = new_key_rows(slots, arena)
        tables: list[int] = []
        tags: list[int] = []
        positions: list[int] = []
        first: list[int] = []
        for s in slots:
            seen = ceil_div(s.start + s.length, arena.block)
            if len(s.kv.blocks) < seen:
                raise RuntimeError("a row's keys are past its KV blocks (ensure() was not called)")
            first += [len(tables)] * s.length
            tables += s.kv.blocks[:seen]
            tags += s.kv.tags[:seen]
            positions += range(s.start, s.start + s.length)
        rows = len(positions)
        # padding rows attend as the first real row (their results are dropped)
        pad = padded - rows
        cols = long_tensor(itertools.chain(tables, tags, positions, [positions[0]] * pad, first, [0] * pad))
        n = len(tables)
        table_t, tag_t = cols[:n], cols[n:2 * n]
        arena.verify(table_t, tag_t)
        return cls(arena, scratch, rows, write_rows, cols[2 * n:2 * n + padded],
                   cols[2 * n + padded:], table_t, max(positions) + 1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """Store the rows' keys and values, then attend each row to its request's keys 0..its position:
        [padded rows, heads * d]."""
        arena, rows = self.arena, self.rows
        d = q.shape[-1]
        kf, vf = arena.flat(layer)
        kf.index_copy_(0, self.write_rows, k[:rows].reshape(-1, d))
        vf.index_copy_(0, self.write_rows, v[:rows].reshape(-1, d))
        out = attend_rows(q, arena.k[layer], arena.v[layer], self.positions, self.first, self.tables,
                          self.context, self.scratch)
        return out.view(q.shape[0], -1)


def attend_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                first: torch.Tensor, tables: torch.Tensor, context: int, scratch: Scratch | None = None) -> torch.Tensor:
    """The kernel on torch's thread count. q: [rows, heads, d]; keys, values: one layer's arena [blocks,
    kv_heads, block, d]; row r at positions[r] reads blocks tables[first[r]:] in order; context: the most
    positions a row reads. Returns [rows, heads, d]."""
    q = q.contiguous()
    out = torch.empty_like(q)
    threads = torch.get_num_threads()
    stride = ceil_div(context, 8) * 8
    shape = (threads, stride)
    scores = scratch.take("row-scores", shape, torch.float32) if scratch is not None else torch.empty(shape)
    d = q.shape[-1]
    native.library().rowattn(q.data_ptr(), keys.data_ptr(), values.data_ptr(), positions.data_ptr(),
                             first.data_ptr(), tables.data_ptr(), q.shape[0], q.shape[1], keys.shape[1], d,
                             keys.shape[2], d ** -0.5, scores.data_ptr(), stride, out.data_ptr(), threads)
    return out


@dataclass(frozen=True)
class ProbeRequests:
    """Three requests' rows as the probes lay them out (`holds` here and in tether/model/rowlayer.py): contexts
    of 2.5 blocks, half a block and 3, and 7 positions, their blocks scattered in an arena of `arena_blocks`."""

    arena_blocks: int
    blocks: list[list[int]]   # each request's blocks, in position order
    tables: list[int]         # the requests' tables, one after the other
    first: list[int]          # per row: where its request's table starts in `tables`
    positions: list[int]      # per row: its position in its request
    context: int              # the longest request's positions

    @classmethod
    def scattered(cls, block: int, g: torch.Generator) -> "ProbeRequests":
        lengths = (block * 5 // 2, block // 2 + 3, 7)
        used = sum(ceil_div(n, block) for n in lengths)
        order = torch.randperm(used + 3, generator=g).tolist()
        blocks: list[list[int]] = []
        first: list[int] = []
        positions: list[int] = []
        for n in lengths:
            first += [sum(map(len, blocks))] * n
            blocks.append(order[sum(map(len, blocks)):][:ceil_div(n, block)])
            positions += range(n)
        return cls(used + 3, blocks, [b for mine in blocks for b in mine], first, positions, max(lengths))


def holds(heads: int, kv_heads: int, head_dim: int, block: int, threads: tuple[int, ...]) -> bool:
    """The probe's check (tether/model/numerics.py): three requests' rows (contexts up to 2.5 blocks, their
    blocks scattered in the arena) attended all at once on 1 thread, then in windows of 1, 2, 3, 5, 17 and 48
    rows (a decode row alone, chunked prefills) on each thread count: the same bits, row for row."""
    if not supports(head_dim) or heads % kv_heads:
        return False
    g = torch.Generator().manual_seed(11)
    reqs = ProbeRequests.scattered(block, g)
    keys, values = (torch.randn(reqs.arena_blocks, kv_heads, block, head_dim, generator=g) for _ in range(2))
    positions = reqs.positions
    q = torch.randn(len(positions), heads, head_dim, generator=g) * 4
    pos_t, first_t, tables_t = (long_tensor(v) for v in (positions, reqs.first, reqs.tables))
    context = reqs.context
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = attend_rows(q, keys, values, pos_t, first_t, tables_t, context)
        for t in threads:
            torch.set_num_threads(t)
            for m in (1, 2, 3, 5, 17, 48):
                for s in range(0, len(positions) - m + 1, m):
                    got = attend_rows(q[s:s + m], keys, values, pos_t[s:s + m], first_t[s:s + m], tables_t, context)
                    if not torch.equal(got, whole[s:s + m]):
                        return False
    finally:
        torch.set_num_threads(before)
    return True
