"""A small micro-batch runs on fewer threads (`invariant_threads`): with unit u, 1..u rows on 1 thread padded to
u, instead of T threads padded to u*T. These tests pin the claim it rests on, bitwise, for every row count
1..70 at 1 and 2 threads and every linear shape of the presets tiny and small and of SmolLM2-135M: a row's
result is the same whichever thread count and padding this machine's rule (tether/model/numerics.py) picks."""

from __future__ import annotations

import pytest
import torch

from tether.model import numerics
from tether.model.config import ModelConfig
from tether.model.invariant import KERNELS, RowRule, invariant_threads, pad_rows, padded_rows, threads_for
from tether.model.llama import SlotRows
from tether.model.loader import load_slice, resolve_model

ROWS = range(1, 71)
# (in, out) of every linear layer of the presets tiny and small and of SmolLM2-135M (its head excepted)
SHAPES = {"tiny": [(256, 256), (256, 128), (256, 688), (688, 256), (256, 272)],
          "small": [(512, 512), (512, 256), (512, 1376), (1376, 512), (512, 272)],
          "smollm2": [(576, 576), (576, 192), (576, 1536), (1536, 576)]}


def test_threads_for_uses_no_more_threads_than_units_of_rows_nor_than_the_cap():
    four, sixteen = RowRule(4), RowRule(16)
    assert [threads_for(r, four, 2) for r in (0, 1, 4, 5, 8, 9, 70)] == [1, 1, 1, 2, 2, 2, 2]
    assert [threads_for(r, four, 4) for r in (1, 5, 9, 12, 13, 64)] == [1, 2, 3, 3, 4, 4]
    assert [threads_for(r, sixteen, 2) for r in (1, 16, 17, 70)] == [1, 1, 2, 2]
    assert [threads_for(r, RowRule(16, threads=1), 2) for r in (1, 17, 70)] == [1, 1, 1]
    assert threads_for(70, four, 1) == 1
    # alone in the pipeline (the other stages' cores idle): `wide` threads whatever the rows, the cap still holds
    assert [threads_for(r, four, 1, wide=2) for r in (1, 4, 70)] == [2, 2, 2]
    assert threads_for(1, four, 4, wide=3) == 3
    assert threads_for(1, RowRule(16, threads=1), 2, wide=2) == 1
    assert [padded_rows(r, sixteen, 2) for r in (1, 32, 33)] == [32, 32, 64]
    assert [padded_rows(r, RowRule(None, 2)) for r in (1, 2, 33)] == [2, 2, 33]


def test_invariant_threads_lowers_the_count_inside_and_restores_it(threads):
    rule = RowRule(4)
    with invariant_threads(1, rule) as used:
        assert used == torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads
    with pytest.raises(RuntimeError):
        with invariant_threads(3, rule):
            raise RuntimeError("a failed step")
    assert torch.get_num_threads() == threads
    with invariant_threads(70, rule) as used:
        assert used == torch.get_num_threads() == threads
    with invariant_threads(70, RowRule(4, threads=1)) as used:
        assert used == torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads


def _rule(model: str) -> RowRule:
    return numerics.row_rule(ModelConfig.from_folder(resolve_model(model)), torch.float32)


def _linear_rows(x: torch.Tensor, w: torch.Tensor, rule: RowRule) -> torch.Tensor:
    """x's rows through F.linear the way an invariant forward runs them: threads and padding by the rule."""
    rows = x.shape[0]
    with invariant_threads(rows, rule):
        kernel = KERNELS[rule.linear]
        return kernel.linear(pad_rows(x, padded_rows(rows, rule)), kernel.prepare(w), None)[:rows]


@pytest.mark.parametrize("model,inner,outer", [(m, i, o) for m, shapes in SHAPES.items() for i, o in shapes])
def test_a_linear_row_has_the_same_bits_at_every_row_count(threads, model, inner, outer):
    rule = _rule(model)
    g = torch.Generator().manual_seed(inner * outer)
    w = torch.randn(outer, inner, generator=g) / inner ** 0.5
    x = torch.randn(max(ROWS), inner, generator=g)
    want = torch.cat([_alone(x[i:i + 1], w, rule) for i in range(len(x))])
    for rows in ROWS:
        assert torch.equal(_linear_rows(x[:rows], w, rule), want[:rows]), f"{rows} rows at {threads} threads ({rule})"


def _alone(row: torch.Tensor, w: torch.Tensor, rule: RowRule, gate: bool = False) -> torch.Tensor:
    """One row alone on 1 thread (padded to one unit): the bits every batch must reproduce."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kernel = KERNELS[rule.linear]
        run = kernel.gate if gate else kernel.linear
        return run(pad_rows(row, padded_rows(1, rule, 1)), kernel.prepare(w), None)[:1]
    finally:
        torch.set_num_threads(before)


# Past 70 rows too: a SiLU over [M, 688] unfused (tiny) changed bits at odd M >= 55 on 2 threads on an AMD EPYC
# without AVX-512, where its vector loop's chunks end mid-vector.
GATE_ROWS = [*ROWS, 83, 99, 127, 128, 129, 160]


@pytest.mark.parametrize("model,inner,outer", [(m, i, o) for m, shapes in SHAPES.items() for i, o in shapes[2:3]])
def test_a_gate_row_with_its_silu_has_the_same_bits_at_every_row_count(threads, model, inner, outer):
    """The MLP's gate projection and its SiLU (`Kernel.gate`, fused into oneDNN's matmul or not)."""
    rule = _rule(model)
    g = torch.Generator().manual_seed(inner + outer)
    w = torch.randn(outer, inner, generator=g) / inner ** 0.5
    x = torch.randn(max(GATE_ROWS), inner, generator=g) * 3
    want = torch.cat([_alone(x[i:i + 1], w, rule, gate=True) for i in range(len(x))])
    for rows in GATE_ROWS:
        with invariant_threads(rows, rule):
            kernel = KERNELS[rule.linear]
            got = kernel.gate(pad_rows(x[:rows], padded_rows(rows, rule)), kernel.prepare(w), None)[:rows]
        assert torch.equal(got, want[:rows]), f"{rows} rows at {threads} threads ({rule})"


@pytest.fixture(scope="module")
def tiny():
    return load_slice(resolve_model("tiny"))


def test_a_decode_step_has_the_same_bits_among_0_to_69_neighbours(tiny, threads):
    """A request's decode logits alone at 1 thread, and batched with 0..69 other decodes at 1 or 2 threads
    (so 1..70 rows: below, at and past the rows where fewer threads are used)."""
    g = torch.Generator().manual_seed(5)
    contexts = torch.randint(1, 150, (max(ROWS),), generator=g).tolist()
    kvs = []
    for n in contexts:
        kv = tiny.new_kv()
        kv.ensure(n + 1)
        tiny(torch.randint(0, 256, (n,), generator=g), [SlotRows(kv, 0, n)])
        kv.length = n
        kvs.append(kv)
    ids = torch.randint(0, 256, (max(ROWS),), generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = tiny.logits(tiny(ids[:1], [SlotRows(kvs[0], contexts[0], 1)]))
    finally:
        torch.set_num_threads(before)
    for rows in ROWS:
        h = tiny(ids[:rows], [SlotRows(kv, n, 1) for kv, n in zip(kvs[:rows], contexts)])
        assert torch.equal(tiny.logits(h)[:1], want), f"{rows} rows at {threads} threads"
    for rows in (1, 2, 5, 70):   # alone in the pipeline: on 2 threads whatever the rows
        h = tiny(ids[:rows], [SlotRows(kv, n, 1) for kv, n in zip(kvs[:rows], contexts)], wide=2)
        assert torch.equal(tiny.logits(h, wide=2)[:1], want), f"{rows} rows alone on 2 threads"
    for kv in kvs:
        kv.release()
