"""Batch-invariant attention over the paged KV arena, as tiles.

A tile is up to `block` query positions of one request, GQA heads folded into its rows and padded by
`padded_rows`. It is paired with each key block its positions can see, one (tile, block) pair per matrix of
a batched GEMM. Pairs of all requests are batched together, but every reduction stays inside a pair or a
tile: the row max over a tile's pairs (exact in any order), the row sum over one fixed-size block, and the
sum over a tile's blocks in block order (index_add_ adds a tile's pairs one after the other, starting from
zero). A key past a query's position is masked and adds an exact zero, so prefill, chunked prefill and
decode agree bit for bit. tether/model/invariant.py has the rules this relies on.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from tether.kv.paged import BlockArena, PagedKV, long_tensor
from tether.mathutil import ceil_div
from tether.model.invariant import RowRule, padded_rows

# Masked scores: below any real score, so a masked key never wins a row max; finite, so a row or block with
# nothing visible stays NaN-free. Masked keys are zeroed after exp.
MASKED = -1e30
# Lowest exp input whose result is a normal float32 (exp(-87) = 1.6e-38): anything lower is clamped to it.
EXP_FLOOR = -87.0
# Elements per batch of tiles, of its scores and (separately) of its gathered keys: small enough that a
# batch's gathered blocks are still in cache when its GEMMs read them (tiny, B=32 at context 1024: 0.65x the
# plain kernels with 4M, 0.84-0.97x over three runs with 1M, 0.71x with 256K: too many batches), and
# bounding the scratch memory of a long prefill. A batch holds at least one tile whatever its size.
BATCH_ELEMENTS = 1 << 20


class Scratch:
    """Buffers reused from step to step: a fresh multi-megabyte tensor per op costs more in page faults than
    the op itself (index_select of 6 MB: 0.9 ms into a new tensor, 0.12 ms into a reused one)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(shape)


@dataclass(frozen=True)
class Tile:
    row: int        # first row in the micro-batch
    position: int   # that row's position in its request
    count: int      # query positions, at most one block
    kv: PagedKV


@functools.lru_cache(maxsize=1024)
def tile_layout(count: int, height: int, heads: int, kv_heads: int, block: int) -> tuple[torch.Tensor, ...]:
    """The rows of a tile of `count` positions: kv head h holds query heads h*group .. h*group+group-1, each
    for `count` positions, then padding rows that repeat the tile's first query (their results are dropped).

    Returns: each row's query as an offset from the tile's first row of q viewed as [rows * heads, d]
    ([kv_heads, height]); each row's position from the tile's first ([height, 1]); the real (not padding)
    rows ([height, 1]); and the key offsets in a block ([block])."""
    group = heads // kv_heads
    p = torch.arange(height)
    i, g = p % count, p // count
    pad = p >= group * count
    offset = (i * heads + g + torch.arange(kv_heads)[:, None] * group).masked_fill_(pad, 0)
    return offset, i[:, None], ~pad[:, None], torch.arange(block)


@functools.lru_cache(maxsize=64)
def output_rows(padded: int, heads: int, kv_heads: int, block: int,
                layout: tuple[tuple[int, int, tuple[int, ...]], ...]) -> tuple[torch.Tensor, int]:
    """Where each (row, head) of a micro-batch's attention output comes from among its batches' tile rows,
    and how many tile rows there are. `layout`: (count, height, first rows of the tiles) per batch. Cached: it
    depends on the tiles' shapes and rows, not their positions, so a run of decode steps builds it once.
    GEMM padding rows (past the real ones) read output 0: any finite row will do, they are dropped."""
    out_index = torch.zeros(padded * heads, dtype=torch.long)
    outputs = 0
    for count, height, rows in layout:
        offset = tile_layout(count, height, heads, kv_heads, block)[0]
        real = heads // kv_heads * count
        q_index = torch.tensor(rows)[:, None, None] * heads + offset              # [tiles, kv_heads, height]
        source = torch.arange(outputs, outputs + q_index.numel()).view(q_index.shape)
        out_index[q_index[:, :, :real].flatten()] = source[:, :, :real].flatten()
        outputs += q_index.numel()
    return out_index, outputs


@dataclass
class TileBatch:
    """Tiles with the same number of query positions, attended by one set of ops."""

    tiles: int
    count: int                 # query positions of each tile
    rows: tuple[int, ...]      # each tile's first row in the micro-batch
    height: int
    real: int                  # real rows of a tile per kv head (the rest pad it to `height`)
    q_index: torch.Tensor      # [tiles, kv_heads, height] rows of q viewed as [rows * heads, d]
    pair_tile: torch.Tensor    # [pairs] tile of each (tile, key block) pair, tiles' pairs in block order
    pair_block: torch.Tensor   # [pairs] arena block of each pair
    pair_q: torch.Tensor       # [pairs * kv_heads * height] q_index of each pair's tile
    hidden: torch.Tensor       # [pairs, 1, height, block]: the key is past the query (padding rows see all)

    @classmethod
    def build(cls, tiles: list[Tile], heads: int, kv_heads: int, arena: BlockArena, rule: RowRule) -> "TileBatch":
        block, count = arena.block, tiles[0].count
        height = padded_rows(heads // kv_heads * count, rule.tiles())
        offset, i, real, keys = tile_layout(count, height, heads, kv_heads, block)
        pair_tile, blocks, tags = [], [], []
        starts: list[int] = []
        for n, t in enumerate(tiles):   # plain ints: a step's plan is mostly Python, keep it lean
            seen = ceil_div(t.position + count, block)
            if len(t.kv.blocks) < seen:
                raise RuntimeError("a tile's keys are past its KV blocks (ensure() was not called)")
            pair_tile += [n] * seen
            blocks += t.kv.blocks[:seen]
            tags += t.kv.tags[:seen]
            starts += range(t.position, t.position - seen * block, -block)   # position - j * block
        columns = long_tensor(itertools.chain(pair_tile, blocks, tags, starts, (t.row * heads for t in tiles)))
        pair_tile, pair_block, pair_serial, first_pos = columns[:-len(tiles)].view(4, -1)
        arena.verify(pair_block, pair_serial)
        q_index = columns[-len(tiles):, None, None] + offset                     # [tiles, kv_heads, height]
        # key j*block + k is past query i of a tile at position pos: k > pos - j*block + i
        hidden = (keys > first_pos[:, None, None] + i) & real                     # [pairs, height, block]
        return cls(len(tiles), count, tuple(t.row for t in tiles), height, heads // kv_heads * count, q_index,
                   pair_tile, pair_block, q_index.index_select(0, pair_tile).flatten(), hidden.unsqueeze(1))


def new_key_rows(slots, arena: BlockArena) -> torch.Tensor:
    """Ready every slot's KV for its rows (`prepare_write`) and return the rows of the arena's flat K/V its new
    keys go to, slot after slot: what a step's attention plan writes, whichever kernel attends."""
    blocks: list[int] = []
    offsets: list[int] = []
    for s in slots:
        s.kv.prepare_write(s.start, s.length)
        b, o = s.kv.locate(s.start, s.start + s.length)
        blocks += b
        offsets += o
    return arena.flat_rows(blocks, offsets)


@dataclass
class AttentionPlan:
    """Everything a micro-batch's attention needs besides q/k/v; built once per step, used by every layer."""

    arena: BlockArena
    scratch: Scratch
    rows: int                  # real rows (the micro-batch may be padded past them)
    write_rows: torch.Tensor   # [rows * kv_heads] rows of the arena's flat K/V for the new keys
    batches: list[TileBatch]
    out_index: torch.Tensor    # [padded rows * heads] rows of the batches' outputs, one after the other
    outputs: int               # tile rows over all batches

    @classmethod
    def build(cls, slots, padded: int, heads: int, kv_heads: int, scratch: Scratch,
              rule: RowRule) -> "AttentionPlan":
        """`slots`: SlotRows with PagedKV whose blocks cover their rows (`ensure`); `rule`: how tile heights
        pad (`padded_rows`), as the micro-batch's rows do."""
        arena = slots[0].kv.arena
        head_dim = arena.head_dim
        block = arena.block
        by_count: dict[int, list[Tile]] = {}
        row = 0
        write_rows = new_key_rows(slots, arena)
        for s in slots:
            for first in range(0, s.length, block):
                t = Tile(row + first, s.start + first, min(block, s.length - first), s.kv)
                by_count.setdefault(t.count, []).append(t)
            row += s.length
        batches = []
        for count, tiles in by_count.items():
            # split so that one batch's scores and gathered keys stay within BATCH_ELEMENTS each (a batch
            # holds at least one tile)
            height = padded_rows(heads // kv_heads * count, rule.tiles())
            unit = kv_heads * max(height, head_dim) * block
            start = size = 0
            for n, t in enumerate(tiles):
                pairs = ceil_div(t.position + count, block)
                if n > start and size + pairs * unit > BATCH_ELEMENTS:
                    batches.append(TileBatch.build(tiles[start:n], heads, kv_heads, arena, rule))
                    start, size = n, 0
                size += pairs * unit
            batches.append(TileBatch.build(tiles[start:], heads, kv_heads, arena, rule))
        layout = tuple((b.count, b.height, b.rows) for b in batches)
        out_index, outputs = output_rows(padded, heads, kv_heads, block, layout)
        return cls(arena, scratch, row, write_rows, batches, out_index, outputs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """One layer's attention for the micro-batch (`tile_attention`): [padded rows, heads * d]."""
        return tile_attention(q, k, v, layer, self)


def tile_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, plan: AttentionPlan) -> torch.Tensor:
    """Store the micro-batch's keys and values, then attend every request's queries to its own keys.

    q: [padded rows, heads, d]; k, v: [padded rows, kv_heads, d]. Returns [padded rows, heads * d].
    """
    arena, rows = plan.arena, plan.rows
    d, kv_heads = q.shape[-1], k.shape[1]
    kf, vf = arena.flat(layer)
    kf.index_copy_(0, plan.write_rows, k[:rows].reshape(-1, d))
    vf.index_copy_(0, plan.write_rows, v[:rows].reshape(-1, d))
    qf = q.reshape(-1, d)
    scratch, dt = plan.scratch, q.dtype
    out_all = q.new_zeros(plan.outputs, d)
    offset = 0
    for b in plan.batches:
        pairs = b.pair_block.numel()
        blocks = (pairs, kv_heads, arena.block, d)
        qp = torch.index_select(qf, 0, b.pair_q, out=scratch.take("q", (pairs * kv_heads * b.height, d), dt))
        qp.mul_(d ** -0.5)
        keys = torch.index_select(arena.k[layer], 0, b.pair_block, out=scratch.take("kv", blocks, dt))
        scores = torch.matmul(qp.view(pairs, kv_heads, b.height, d), keys.mT,
                              out=scratch.take("scores", (pairs, kv_heads, b.height, arena.block), dt))
        scores.masked_fill_(b.hidden, MASKED)
        pair_max = scores.amax(-1)
        row_max = torch.full((b.tiles, kv_heads, b.height), MASKED, dtype=dt).scatter_reduce_(
            0, b.pair_tile.view(-1, 1, 1).expand_as(pair_max), pair_max, "amax")
        # exp of an input whose result is not a normal float (a masked score, or one 87 below the row's
        # max) takes a slow path, 6x slower here; clamp to exp's normal range, then zero masked keys exactly.
        p = scores.sub_(row_max.index_select(0, b.pair_tile).unsqueeze(-1)).clamp_(min=EXP_FLOOR).exp_()
        p.masked_fill_(b.hidden, 0)
        values = torch.index_select(arena.v[layer], 0, b.pair_block, out=scratch.take("kv", blocks, dt))
        block_out = torch.matmul(p, values, out=scratch.take("out", (pairs, kv_heads, b.height, d), dt))
        total = q.new_zeros(b.tiles, kv_heads, b.height).index_add_(0, b.pair_tile, p.sum(-1))
        n = b.q_index.numel()
        out = out_all[offset:offset + n].view(b.tiles, kv_heads, b.height, d).index_add_(0, b.pair_tile, block_out)
        out.div_(total.unsqueeze(-1))
        offset += n
    return out_all.index_select(0, plan.out_index).view(q.shape[0], -1)
