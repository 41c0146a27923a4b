"""The paged KV arena: block ownership, zeroing, growth, pool accounting, and the tags that catch a broken table."""

from __future__ import annotations

import pytest
import torch

from tether.kv.blocks import NoCapacity
from tether.kv.paged import BlockArena, PagedKV

BLOCK = 4


@pytest.fixture
def arena() -> BlockArena:
    return BlockArena(num_layers=2, kv_heads=2, head_dim=3, dtype=torch.float32, block=BLOCK)


def fill(arena: BlockArena, kv: PagedKV, value: float) -> None:
    for t in (*arena.k, *arena.v):
        t.index_fill_(0, torch.tensor(kv.blocks), value)


def test_blocks_cover_exactly_what_is_ensured(arena):
    kv = PagedKV(arena)
    kv.ensure(1)
    assert len(kv.blocks) == 1 and kv.capacity == BLOCK
    kv.ensure(BLOCK)
    assert len(kv.blocks) == 1
    kv.ensure(BLOCK + 1)
    assert len(kv.blocks) == 2 and kv.capacity == 2 * BLOCK
    kv.ensure(3)                               # never shrinks
    assert len(kv.blocks) == 2


def test_requests_never_share_a_block_and_freed_blocks_come_back_zeroed(arena):
    kvs = [PagedKV(arena) for _ in range(5)]
    for i, kv in enumerate(kvs):
        kv.ensure(3 * BLOCK + i)               # forces the arena to grow past its first 16 blocks
        fill(arena, kv, float(i + 1))
    held = [b for kv in kvs for b in kv.blocks]
    assert len(held) == len(set(held)), "a block was handed to two requests"
    assert arena.used_blocks == len(held)
    for i, kv in enumerate(kvs):               # growth copied every request's keys
        assert all(bool((t[torch.tensor(kv.blocks)] == i + 1).all()) for t in (*arena.k, *arena.v))
    freed = list(kvs[2].blocks)
    kvs[2].release()
    assert kvs[2].blocks == [] and kvs[2].length == 0
    again = PagedKV(arena)
    again.ensure(len(freed) * BLOCK)
    assert sorted(again.blocks) == sorted(freed)
    assert all(bool((t[torch.tensor(again.blocks)] == 0).all()) for t in (*arena.k, *arena.v))


def test_owner_tags_catch_a_table_pointing_at_someone_elses_block(arena):
    a, b = PagedKV(arena), PagedKV(arena)
    a.ensure(BLOCK)
    b.ensure(BLOCK)
    arena.verify(torch.tensor(a.blocks + b.blocks), torch.tensor([a.serial, b.serial]))
    a.blocks = list(b.blocks)                  # a corrupted table
    with pytest.raises(RuntimeError, match="owner tags"):
        arena.verify(torch.tensor(a.blocks), torch.tensor([a.serial]))
    with pytest.raises(RuntimeError, match="owner tags"):
        a.release()                            # and it cannot free b's block either
    assert arena.owner[b.blocks[0]] == b.serial


def test_pool_is_charged_per_block_and_refunded():
    arena = BlockArena(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, block=BLOCK, max_blocks=3)
    kv = PagedKV(arena)
    kv.ensure(BLOCK + 1)
    assert arena.used_blocks == 2
    other = PagedKV(arena)
    with pytest.raises(NoCapacity):
        other.ensure(2 * BLOCK)
    assert arena.used_blocks == 2 and other.blocks == []
    kv.release()
    assert arena.used_blocks == 0


def test_a_shared_cached_block_survives_its_first_holder_and_is_checked_by_tag(arena):
    a = PagedKV(arena)
    a.ensure(2 * BLOCK)
    fill(arena, a, 7.0)
    entry = arena.pool.register(a.blocks[0], key=("seed", 1))
    assert entry is not None
    b = PagedKV(arena)
    b.attach([a.blocks[0]])
    assert b.length == BLOCK and b.tags == [a.serial]
    a.release()                                # the cached block stays, with its keys, for b
    assert arena.used_blocks == 1
    assert bool((arena.k[0][b.blocks[0]] == 7.0).all())
    arena.verify(torch.tensor(b.blocks), torch.tensor(b.tags))
    block = b.blocks[0]
    b.release()                                # nobody holds it: cached, evictable, keys kept
    assert arena.used_blocks == 0 and arena.pool.lookup(("seed", 1)) == block
    assert list(arena.pool.evictable) == [block] and arena.owner[block] == a.serial


def test_eviction_retags_a_block_so_a_stale_table_cannot_read_it():
    arena = BlockArena(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, block=BLOCK, max_blocks=2)
    a = PagedKV(arena)
    a.ensure(BLOCK)
    block, tag = a.blocks[0], a.tags[0]
    arena.pool.register(block, key="k")
    a.release()
    c = PagedKV(arena)
    c.ensure(2 * BLOCK)                        # needs both blocks: the cached one is evicted
    assert arena.pool.counters.evictions == 1 and arena.pool.lookup("k") is None
    assert block in c.blocks and bool((arena.k[0][block] == 0).all())
    with pytest.raises(RuntimeError, match="owner tags"):
        arena.verify(torch.tensor([block]), torch.tensor([tag]))


def test_zero_and_scrub_touch_only_the_given_positions(arena):
    kv = PagedKV(arena)
    kv.ensure(3 * BLOCK)
    fill(arena, kv, 5.0)
    kv.zero(2, BLOCK + 1)

    def position(p: int) -> list[torch.Tensor]:
        return [t[kv.blocks[p // BLOCK], :, p % BLOCK] for t in (*arena.k, *arena.v)]

    for p in range(3 * BLOCK):
        want = 0.0 if 2 <= p < BLOCK + 1 else 5.0
        assert all(bool((x == want).all()) for x in position(p)), p
    kv.written = 3 * BLOCK                     # a failed step wrote everything
    kv.prepare_write(0, 2)                     # the retry covers 0..1: the rest is scrubbed
    assert all(bool((x == 0).all()) for p in range(2, 3 * BLOCK) for x in position(p))
    assert kv.written == 2


def test_flat_rows_address_position_major_then_head(arena):
    kv = PagedKV(arena)
    kv.ensure(2 * BLOCK)
    rows = arena.flat_rows(*kv.locate(BLOCK - 1, BLOCK + 1))
    k = torch.arange(2 * 2 * 3, dtype=torch.float32).view(2, 2, 3)     # [positions, heads, d]
    arena.flat(0)[0].index_copy_(0, rows, k.reshape(-1, 3))
    for i, p in enumerate((BLOCK - 1, BLOCK)):
        assert torch.equal(arena.k[0][kv.blocks[p // BLOCK], :, p % BLOCK], k[i])


def test_gather_returns_the_plain_layout(arena):
    kv = PagedKV(arena)
    kv.ensure(BLOCK + 2)
    keys = torch.randn(BLOCK + 2, 2, 3)
    arena.flat(1)[0].index_copy_(0, arena.flat_rows(*kv.locate(0, BLOCK + 2)), keys.reshape(-1, 3))
    kv.length = BLOCK + 2
    k, v = kv.gather(1)
    assert torch.equal(k, keys.transpose(0, 1)) and torch.equal(v, torch.zeros(2, BLOCK + 2, 3))


def test_a_bounded_arena_holds_its_capacity_and_no_more():
    arena = BlockArena(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, block=BLOCK, max_blocks=20)
    assert arena.num_blocks == 20
    kv = PagedKV(arena)
    kv.ensure(17 * BLOCK)
    with pytest.raises(NoCapacity):
        kv.ensure(21 * BLOCK)
    assert arena.num_blocks == 20 and len(kv.blocks) == 17


def test_an_unbounded_arena_grows_by_doubling_and_keeps_its_contents():
    arena = BlockArena(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, block=BLOCK)
    assert arena.num_blocks == 0
    kv = PagedKV(arena)
    kv.ensure(10 * BLOCK)
    fill(arena, kv, 3.0)
    assert arena.num_blocks == 16
    kv.ensure(17 * BLOCK)
    assert arena.num_blocks == 32
    assert bool((arena.k[0][kv.blocks[:10]] == 3.0).all()) and bool((arena.k[0][kv.blocks[10:]] == 0).all())


def test_a_bounded_arena_is_one_allocation_touched_as_used():
    """A stage's pool takes its whole capacity at once (no copy as it fills: the same tensors throughout) and
    counts as resident only the blocks ever handed out; a freed block is handed out again before a new one."""
    arena = BlockArena(num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, block=BLOCK, max_blocks=8)
    tensors = [t.data_ptr() for t in arena.k + arena.v]
    assert arena.num_blocks == 8 and arena.touched_blocks == 0 and not arena.prefaulted
    assert arena.block_bytes == 2 * 2 * 1 * BLOCK * 2 * 4
    a = PagedKV(arena)
    a.ensure(3 * BLOCK)
    assert arena.touched_blocks == 3
    fill(arena, a, 5.0)
    a.release()
    b = PagedKV(arena)
    b.ensure(2 * BLOCK)                        # freed blocks first: nothing new is touched
    assert arena.touched_blocks == 3
    assert all(bool((arena.k[layer][blk] == 0).all()) for layer in range(2) for blk in b.blocks)   # zeroed
    c = PagedKV(arena)
    c.ensure(5 * BLOCK)                        # the last freed one, then 4 never used
    assert arena.touched_blocks == 7
    assert [t.data_ptr() for t in arena.k + arena.v] == tensors


def test_a_prefaulted_arena_is_resident_and_zero_from_the_start():
    arena = BlockArena(num_layers=1, kv_heads=2, head_dim=3, dtype=torch.float32, block=BLOCK, max_blocks=5,
                       prefault=True)
    assert arena.prefaulted and arena.touched_blocks == 5
    assert all(bool((t == 0).all()) for t in arena.k + arena.v)
