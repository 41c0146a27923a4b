"""rowattn (tether/model/rowattn.py, kernels/rowattn.c): the attention it computes, a row's bits whatever rows
share its call, the probe's check failing where they would not, and the owner tags checked before a row reads a
block. Skipped where our kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from tether.kv.paged import long_tensor
from tether.model import native, rowattn
from tether.model.llama import SlotRows
from tether.model.loader import load_slice, resolve_model

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"our kernels do not run here: {native.available()}")

BLOCK = 16


def _arena(g: torch.Generator, lengths: list[int], kv_heads: int = 2, d: int = 16):
    """Keys and values of requests of `lengths` positions, their blocks scattered; each row's table start."""
    used = sum(-(-n // BLOCK) for n in lengths)
    order = torch.randperm(used + 2, generator=g).tolist()
    keys, values = (torch.randn(used + 2, kv_heads, BLOCK, d, generator=g) for _ in range(2))
    tables, first, positions, owners, taken = [], [], [], [], 0
    for n in lengths:
        seen = -(-n // BLOCK)
        first += [len(tables)] * n
        tables += order[taken:taken + seen]
        positions += range(n)
        owners.append(order[taken:taken + seen])
        taken += seen
    return keys, values, long_tensor(tables), long_tensor(first), long_tensor(positions), owners


@pytest.mark.parametrize("d", [16, 64, 128])   # any d % 8; 64 at a time in registers; two passes of 64
def test_it_computes_causal_attention(d):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads = 6, 2
    keys, values, tables, first, positions, owners = _arena(g, [37, 5], kv_heads, d)
    q = torch.randn(42, heads, d, generator=g) * 3
    got = rowattn.attend_rows(q, keys, values, positions, first, tables, 37)
    row = 0
    for blocks, n in zip(owners, (37, 5)):
        k = keys[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :n].double()   # [kv_heads, n, d]
        v = values[blocks].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :n].double()
        for p in range(n):
            for h in range(heads):
                s = (k[h // 3, :p + 1] @ q[row + p, h].double()) * d ** -0.5
                want = torch.softmax(s, 0) @ v[h // 3, :p + 1]
                assert torch.allclose(got[row + p, h].double(), want, atol=1e-5), (p, h)
        row += n


@pytest.mark.parametrize("d", [16, 64, 24, 128])
def test_the_avx512_sums_give_the_avx2_bits(d):
    """Where the CPU has AVX-512 the values' sums run 16 elements an instruction, 64 elements a pass (d % 64 == 0:
    128 in two; 16 and 24 stay AVX2): the same bits as AVX2's 8 (forced here), keys' scores eight and four at a
    time included."""
    lib = native.library()
    if not lib.kernels_isa(1):
        pytest.skip("no AVX-512 (F, BW, DQ, VL) here")
    g = torch.Generator().manual_seed(d)
    keys, values, tables, first, positions, _ = _arena(g, [70, 3, 33], 2, d)
    q = torch.randn(106, 6, d, generator=g) * 3
    try:
        wide = rowattn.attend_rows(q, keys, values, positions, first, tables, 70)
        lib.kernels_isa(0)
        narrow = rowattn.attend_rows(q, keys, values, positions, first, tables, 70)
    finally:
        lib.kernels_isa(1)
    assert torch.equal(wide, narrow)


def test_a_row_has_the_same_bits_in_every_call_and_thread_count():
    assert rowattn.holds(heads=9, kv_heads=3, head_dim=64, block=BLOCK, threads=(1, 2, 3))
    assert rowattn.holds(heads=8, kv_heads=8, head_dim=32, block=64, threads=(1, 2))
    assert not rowattn.holds(heads=9, kv_heads=3, head_dim=60, block=BLOCK, threads=(1,))   # d % 8: not served


def test_the_check_fails_where_a_row_would_change_with_its_neighbours(monkeypatch):
    real = rowattn.attend_rows

    def batch_dependent(q, *args, **kwargs):
        out = real(q, *args, **kwargs)
        return torch.nextafter(out, out + 1) if q.shape[0] == 5 else out   # 5-row calls get other bits
    monkeypatch.setattr(rowattn, "attend_rows", batch_dependent)
    assert not rowattn.holds(heads=9, kv_heads=3, head_dim=64, block=BLOCK, threads=(1,))


def test_a_table_whose_tags_do_not_match_is_refused_before_any_read():
    """The plan checks every block a row will read against the arena's owner tags, as the tiles do."""
    m = load_slice(resolve_model("tiny"))
    a, b = m.new_kv(), m.new_kv()
    a.ensure(70)
    b.ensure(10)
    b.blocks[0] = a.blocks[0]      # b's table now points into a's keys
    with pytest.raises(RuntimeError, match="owner tags"):
        rowattn.RowAttentionPlan.build([SlotRows(b, 0, 10)], 10, m.cfg.num_attention_heads,
                                       m.cfg.num_key_value_heads, m.scratch)


def test_the_probes_requests_read_only_their_own_scattered_blocks():
    """The layout both probes (rowattn.holds, rowlayer.holds) check rows on: every row's table is its request's,
    no block is shared, every block is inside the arena."""
    r = rowattn.ProbeRequests.scattered(BLOCK, torch.Generator().manual_seed(0))
    assert [len(b) for b in r.blocks] == [3, 1, 1]                  # 40, 11 and 7 positions of 16
    assert len(set(r.tables)) == len(r.tables) == 5 and max(r.tables) < r.arena_blocks
    assert r.tables != sorted(r.tables) or r.tables[0] != 0          # scattered, not laid out in order
    rows = iter(zip(r.first, r.positions))
    for blocks, n in zip(r.blocks, (40, 11, 7)):
        for p in range(n):
            f, pos = next(rows)
            assert pos == p and r.tables[f:f + len(blocks)] == blocks
    assert r.context == 40
