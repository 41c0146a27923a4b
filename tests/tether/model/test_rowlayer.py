"""rowlayer (tether/model/rowlayer.py, kernels/rowlayer.c): the layer it computes (against float64 and against
torch's modules on a real model), a row's bits whatever rows share its call and on any thread count, and the
probe's check failing where they would not. Skipped where our kernels cannot be built."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from tether.kv.paged import long_tensor
from tether.model import native, rowdot, rowlayer, rowq8, rowquant
from tether.model.llama import SlotRows
from tether.model.loader import load_slice, resolve_model

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"our kernels do not run here: {native.available()}")

BLOCK = 16


def _layer64(x, w, keys, values, cos, sin, heads, kv_heads, eps):
    """One Llama layer in float64 over one request's rows 0..n-1 (causal), from the raw weights."""
    ln1, ln2, wq, wk, wv, wo, wg, wu, wd = w
    n, d = x.shape[0], cos.shape[1]

    def norm(v, g):
        return g * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps))

    def rope(v):
        half = d // 2
        return v * cos[:, None] + torch.cat([-v[..., half:], v[..., :half]], -1) * sin[:, None]

    h = norm(x, ln1)
    q = rope((h @ wq.T).view(n, heads, d))
    k = rope((h @ wk.T).view(n, kv_heads, d))
    v = (h @ wv.T).view(n, kv_heads, d)
    keys.append(k)
    values.append(v)
    group = heads // kv_heads
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for j in range(heads):
        s = (q[:, j] @ k[:, j // group].T) * d ** -0.5
        out[:, j] = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v[:, j // group]
    x = x + out.reshape(n, -1) @ wo.T
    h = norm(x, ln2)
    return x + (torch.nn.functional.silu(h @ wg.T) * (h @ wu.T)) @ wd.T


def test_it_computes_llama_layers():
    g = torch.Generator().manual_seed(3)
    hidden, inter, heads, kv_heads, d, n = 64, 96, 4, 2, 16, 37
    raw = []
    for _ in range(2):
        def w(o, i):
            return torch.randn(o, i, generator=g) * i ** -0.5
        raw.append((1 + 0.1 * torch.randn(hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g),
                    w(heads * d, hidden), w(kv_heads * d, hidden), w(kv_heads * d, hidden), w(hidden, heads * d),
                    w(inter, hidden), w(inter, hidden), w(hidden, inter)))
    layers = [rowlayer.Layer(r[0], r[1], tuple(rowdot.pack(t) for t in r[2:])) for r in raw]
    stack = rowlayer.Stack(rowlayer.Shape(hidden, heads, kv_heads, d, inter, BLOCK, 1e-5, d ** -0.5), layers)
    blocks = -(-n // BLOCK)
    table = torch.randperm(blocks + 2, generator=g)[:blocks].tolist()   # scattered in the arena
    writes = long_tensor([(table[p // BLOCK] * kv_heads + h) * BLOCK + p % BLOCK for p in range(n) for h in range(kv_heads)])
    keys = [torch.zeros(blocks + 2, kv_heads, BLOCK, d) for _ in layers]
    values = [torch.zeros(blocks + 2, kv_heads, BLOCK, d) for _ in layers]
    angles = torch.arange(n, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    x = torch.randn(n, hidden, generator=g)
    got = stack.run(x.clone(), keys, values, cos, sin, writes, long_tensor(range(n)), long_tensor([0] * n),
                    long_tensor(table), n)
    want = x.double()
    k64: list[torch.Tensor] = []
    v64: list[torch.Tensor] = []
    for r in raw:
        want = _layer64(want, [t.double() for t in r], k64, v64, cos.double(), sin.double(), heads, kv_heads, 1e-5)
    assert torch.allclose(got.double(), want, atol=2e-4, rtol=1e-4), (got.double() - want).abs().max()
    # the keys it stored are the request's, where its table says
    stored = keys[1][table].permute(0, 2, 1, 3).reshape(-1, kv_heads, d)[:n]
    assert torch.allclose(stored.double(), k64[1], atol=2e-4)


def test_a_row_has_the_same_bits_in_every_call_and_thread_count():
    assert rowlayer.holds(hidden=64, inter=96, heads=4, kv_heads=2, head_dim=16, block=BLOCK, threads=(1, 2, 3))
    assert rowlayer.holds(hidden=576, inter=1536, heads=9, kv_heads=3, head_dim=64, block=BLOCK, threads=(1, 2))
    assert not rowlayer.holds(hidden=60, inter=96, heads=4, kv_heads=2, head_dim=16, block=BLOCK, threads=(1,))


def test_the_check_fails_where_a_row_would_change_with_its_neighbours(monkeypatch):
    real = rowlayer.Stack.run

    def batch_dependent(self, x, *args, **kwargs):
        out = real(self, x, *args, **kwargs)
        return torch.nextafter(out, out + 1) if x.shape[0] == 3 else out   # 3-row calls get other bits
    monkeypatch.setattr(rowlayer.Stack, "run", batch_dependent)
    assert not rowlayer.holds(hidden=64, inter=96, heads=4, kv_heads=2, head_dim=16, block=BLOCK, threads=(1,))


def test_the_model_runs_on_it_as_its_modules_compute_within_float_noise():
    """tiny through the one-call layers against torch's modules op by op (other
    sums, so other bits): the same greedy tokens, logits within float noise; and a request's logits alone are
    bitwise its logits beside others, at 1 and 2 threads."""
    m = load_slice(resolve_model("tiny"))
    if m.rows.layers != "rowlayer":
        pytest.skip(f"the probe chose {m.rows} here")
    fused, modules = m.rows, dataclasses.replace(m.rows, layers="modules")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, m.cfg.vocab_size, (n,), generator=g) for n in (21, 70, 3)]

    def logits(rule, together: bool) -> list[torch.Tensor]:
        m.rows = rule
        kvs = [m.new_kv() for _ in prompts]
        for kv, p in zip(kvs, prompts):
            kv.ensure(len(p) + 4)
        if together:
            h = m(torch.cat(prompts), [SlotRows(kv, 0, len(p)) for kv, p in zip(kvs, prompts)])
            ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
            out = list(m.logits(h[ends]))
        else:
            out = [m.logits(m(p, [SlotRows(kv, 0, len(p))])[-1:])[0] for kv, p in zip(kvs, prompts)]
        for kv in kvs:
            kv.release()
        return out

    before = torch.get_num_threads()
    try:
        alone = logits(fused, together=False)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert all(torch.equal(a, b) for a, b in zip(alone, logits(fused, together=True)))
        reference = logits(modules, together=False)
    finally:
        m.rows = fused
        torch.set_num_threads(before)
    for a, b in zip(alone, reference):
        assert (a - b).abs().max() < 1e-3 and int(a.argmax()) == int(b.argmax())


def test_tensors_the_kernel_would_misread_are_refused_before_the_call():
    """The C code trusts its shapes: a wrong arena layout, dtype or rotary table is a ValueError, never a read."""
    g = torch.Generator().manual_seed(7)
    stack = rowlayer.random_stack(64, 96, 4, 2, 16, BLOCK, 1, g)
    rows = 3
    good = dict(keys=[torch.zeros(2, 2, BLOCK, 16)], values=[torch.zeros(2, 2, BLOCK, 16)],
                cos=torch.ones(rows, 16), sin=torch.zeros(rows, 16))
    plan = (long_tensor(range(rows * 2)), long_tensor(range(rows)), long_tensor([0] * rows), long_tensor([0]), rows)
    x = torch.randn(rows, 64)
    stack.run(x.clone(), good["keys"], good["values"], good["cos"], good["sin"], *plan)   # as laid out: runs
    for name, bad in [("keys", [torch.zeros(2, 2, BLOCK, 8)]), ("values", [torch.zeros(2, 2, BLOCK, 16).double()]),
                      ("keys", []), ("cos", torch.ones(rows, 8)), ("sin", torch.zeros(rows + 1, 16)),
                      ("values", [torch.zeros(2, BLOCK, 2, 16).transpose(1, 2)])]:
        args = {**good, name: bad}
        with pytest.raises(ValueError, match="rowlayer"):
            stack.run(x.clone(), args["keys"], args["values"], args["cos"], args["sin"], *plan)
    with pytest.raises(ValueError, match="rowlayer"):
        stack.run(x.t().contiguous().t(), good["keys"], good["values"], good["cos"], good["sin"], *plan)


def test_gate_and_up_in_different_formats_take_the_same_chunks():
    """A layer whose gate is rowq8's (one chunk a thread: each call rounds the rows again) and whose up is fp32
    blocks (fours at one row, single blocks from 7): the MLP takes their product chunk by chunk, so the two must be
    chunked alike (the larger unit). Every row then has the same bits on 1, 2 and 3 threads, as with one format."""
    hidden, inter, heads, kv_heads, d = 64, 160, 4, 2, 16   # 10 column blocks of the MLP: fours leave two
    g = torch.Generator().manual_seed(21)
    stack = rowlayer.random_stack(hidden, inter, heads, kv_heads, d, BLOCK, 1, g)
    groups = quantize(np.random.default_rng(3).standard_normal((inter, hidden)).astype(np.float32) * 0.1,
                      GGMLQuantizationType.Q4_1)
    gate = rowq8.pack(rowquant.Blocks("q4_1", torch.from_numpy(np.ascontiguousarray(groups))), inter, hidden)
    layer = stack.layers[0]
    mixed = rowlayer.Stack(stack.shape, [dataclasses.replace(
        layer, projections=(*layer.projections[:4], gate, *layer.projections[5:]))])
    assert mixed.layers[0].projections[4].format != mixed.layers[0].projections[5].format

    def run(rows: int, threads: int) -> torch.Tensor:
        positions = list(range(rows))
        writes = [(p // BLOCK * kv_heads + h) * BLOCK + p % BLOCK for p in positions for h in range(kv_heads)]
        blocks = rows // BLOCK + 1
        keys, values = [torch.zeros(blocks, kv_heads, BLOCK, d)], [torch.zeros(blocks, kv_heads, BLOCK, d)]
        angles = torch.tensor(positions, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1.0, d // 2)
        cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(threads)
            return mixed.run(x, keys, values, cos, sin, long_tensor(writes), long_tensor(positions),
                             long_tensor([0] * rows), long_tensor(list(range(blocks))), rows)
        finally:
            torch.set_num_threads(before)

    for rows in (1, 8):
        one = run(rows, 1)
        assert torch.isfinite(one).all()
        for threads in (2, 3):
            assert torch.equal(run(rows, threads), one), f"{rows} rows on {threads} threads"
