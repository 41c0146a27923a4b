"""Batch invariance, bitwise: a request's logits do not depend on its neighbours, its prompt chunking, the
pipeline split or the thread count (torch.equal, never allclose). In float32 (padded) and in the dtype
`auto` picks here (bfloat16 unpadded where the CPU has it natively and the start-up probe passed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tether.model.config import even_split
from tether.model import numerics
from tether.model.config import ModelConfig
from tether.model.invariant import padded_rows
from tether.model.llama import SlotRows
from tether.model.loader import load_slice, resolve_model
from tests.helpers import run_chunks

VOCAB = 256


@pytest.fixture(scope="module")
def folder():
    return resolve_model("tiny")


@pytest.fixture(scope="module", params=["float32", "auto"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def full(folder, dtype):
    return load_slice(folder, dtype=dtype)


@pytest.fixture(scope="module")
def splits(folder, full, dtype):
    n = full.cfg.num_hidden_layers
    return {s: [load_slice(folder, a, b, dtype) for a, b in even_split(n, s)] for s in (1, 2, 3, 4)}


def test_auto_runs_unpadded_bfloat16_exactly_where_the_probe_passed(folder):
    """fp32 where our kernels run whole layers; else bf16 exactly where the CPU has it and its probe passed."""
    m = load_slice(folder, dtype="auto")
    if numerics.fp32_layers(m.cfg):
        assert m.dtype == torch.float32 and m.rows.layers == "rowlayer"
        return
    native = not numerics.BF16_FLAGS.isdisjoint(numerics.cpu_flags())
    assert (m.dtype == torch.bfloat16) == (native and numerics.unpadded_invariant(m.cfg, torch.bfloat16))
    floor = numerics.unpadded_floor(m.cfg, m.dtype)
    assert m.rows == numerics.row_rule(m.cfg, m.dtype)
    if floor is not None:
        assert (m.rows.unit, m.rows.floor, m.rows.tile_unit) == (None, floor, None)
        assert m.rows.linear in numerics.BF16_KERNELS
    assert not (m.rows.padded and m.dtype == torch.bfloat16)   # auto never picks a padded bf16


def chunking(draw, n: int) -> list[int]:
    chunks, left = [], n
    while left:
        c = draw(st.integers(1, left))
        chunks.append(c)
        left -= c
    return chunks


@st.composite
def request(draw):
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=140))
    return ids, chunking(draw, len(ids))


SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@SETTINGS
@given(req=request(), stages=st.sampled_from([1, 2, 3, 4]))
def test_chunking_and_split_do_not_change_a_bit(full, splits, req, stages):
    ids, chunks = req
    alone = run_chunks([full], ids, [len(ids)])
    assert torch.equal(run_chunks(splits[stages], ids, chunks), alone)
    assert torch.equal(run_chunks([full], ids, [1] * len(ids)), alone)


@st.composite
def neighbourhood(draw):
    """A request's step (prefill chunk or decode) among up to 70 neighbours at arbitrary positions."""
    context = draw(st.integers(0, 150))
    rows = draw(st.integers(1, 40))
    neighbours = draw(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 24)), min_size=0, max_size=70))
    place = draw(st.integers(0, len(neighbours)))
    seed = draw(st.integers(0, 2**31))
    return context, rows, neighbours, place, seed


@SETTINGS
@given(case=neighbourhood(), threads=st.sampled_from([1, 2]))
def test_neighbours_and_threads_do_not_change_a_bit(full, case, threads):
    context, rows, neighbours, place, seed = case
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (context + rows,), generator=g).tolist()
    want = run_chunks([full], ids, [context, rows] if context else [rows])[context:]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kv = full.new_kv()
        kv.ensure(context + rows)
        if context:
            full(torch.tensor(ids[:context]), [SlotRows(kv, 0, context)])
            kv.length = context
        slots, inputs = [], []
        for start, n in neighbours:
            nkv = full.new_kv()
            nkv.ensure(start + n)      # neighbours' earlier context: whatever the buffers hold (finite zeros)
            slots.append(SlotRows(nkv, start, n))
            inputs.append(torch.randint(0, VOCAB, (n,), generator=g))
        slots.insert(place, SlotRows(kv, context, rows))
        inputs.insert(place, torch.tensor(ids[context:]))
        first = sum(s.length for s in slots[:place])
        got = full.logits(full(torch.cat(inputs), slots))[first:first + rows]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)


# --- the torch kernels the tiles rely on (a torch upgrade that breaks one fails here, by name) -----------------


@pytest.mark.parametrize("rows,inner,cols", [(4, 32, 64), (8, 64, 64), (128, 32, 64), (8, 64, 32), (128, 64, 64)])
def test_each_matrix_of_a_bmm_is_the_same_gemm_alone(threads, rows, inner, cols):
    rows = padded_rows(rows, numerics.row_rule(ModelConfig.from_folder(resolve_model("tiny")), torch.float32))
    g = torch.Generator().manual_seed(rows * inner + cols)
    a, b = torch.randn(70, rows, inner, generator=g), torch.randn(70, inner, cols, generator=g)
    together = torch.matmul(a, b)
    for n in (1, 3, 17):
        assert torch.equal(torch.matmul(a[:n], b[:n]), together[:n])
    assert all(torch.equal(torch.matmul(a[i:i + 1], b[i:i + 1])[0], together[i]) for i in range(0, 70, 7))


def test_index_add_sums_each_destination_in_index_order_from_its_initial_value(threads):
    g = torch.Generator().manual_seed(3)
    src = torch.randn(300, 4, 8, 32, generator=g) * torch.logspace(-6, 6, 300)[:, None, None, None]
    index = torch.sort(torch.randint(0, 40, (300,), generator=g)).values
    got = torch.zeros(40, 4, 8, 32).index_add_(0, index, src)
    want = torch.zeros(40, 4, 8, 32)
    for i in range(300):          # one float add after another, in index order
        want[index[i]] = want[index[i]] + src[i]
    assert torch.equal(got, want)
