"""The decoder (and the plain kernels, the benchmark baseline): slicing, incremental decode, micro-batch isolation, loading and fingerprints.

Everything runs on the generated `tiny` preset (4 layers), in float32 on the CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tether.kv.paged import PagedKV
from tether.model import loader
from tether.model.config import ModelConfig, balanced_split, even_split, head_cost, parse_layers
from tether.model.llama import Linear, ModelSlice, SlotRows
from tether.model.loader import load_slice, model_fingerprint, resolve_model
from tether.model.plain import KVCache, PlainSlice
from tether.model.presets import PRESETS, ensure_preset, generate_weights, preset_path

PROMPT_LENGTHS = (1, 2, 7, 16, 33, 70)


@pytest.fixture(scope="module")
def tiny() -> Path:
    return resolve_model("tiny")


@pytest.fixture(scope="module")
def full(tiny) -> ModelSlice:
    return load_slice(tiny)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1000 + 31 * n + seed))


def run(model: ModelSlice | PlainSlice, inputs: torch.Tensor, kv: PagedKV | KVCache,
        start: int | None = None) -> torch.Tensor:
    """Feed rows for one request at its current length (or `start`) and advance its cache."""
    start = kv.length if start is None else start
    n = inputs.shape[0]
    kv.ensure(start + n)
    out = model(inputs, [SlotRows(kv, start, n)])
    kv.length = start + n
    return out


class SpyKV(KVCache):
    """A KVCache that records every write (layer, start, rows)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[tuple[int, int, int]] = []

    def write(self, layer, start, k, v):
        self.writes.append((layer, start, k.shape[1]))
        return super().write(layer, start, k, v)


@pytest.fixture(scope="module")
def plain(tiny) -> PlainSlice:
    """The plain kernels (tether/model/plain.py): contiguous per-request KV, one SDPA call per slot."""
    return PlainSlice(load_slice(tiny))


def spy_kv(model: PlainSlice) -> SpyKV:
    return SpyKV(model.num_layers, model.cfg.num_key_value_heads, model.cfg.head_dim, model.dtype)


def poison(kv: KVCache) -> None:
    """Fill every buffer (including capacity past the length) with NaN."""
    for t in (*kv.k, *kv.v):
        t.fill_(float("nan"))


def held(kv: PagedKV) -> list[torch.Tensor]:
    """Copies of the arena blocks a paged request holds, per layer, K then V."""
    index = torch.tensor(kv.blocks)
    return [t.index_select(0, index) for t in (*kv.arena.k, *kv.arena.v)]


def others(kv: PagedKV, mine: list[int]) -> list[torch.Tensor]:
    """Copies of every arena block not in `mine` (NaN read as 7, so that equal means unchanged)."""
    rest = torch.tensor([b for b in range(kv.arena.num_blocks) if b not in mine])
    return [t.index_select(0, rest).nan_to_num(7.0) for t in (*kv.arena.k, *kv.arena.v)]


# --- slicing --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_consecutive_slices_equal_full_model(tiny, full, stages, n):
    ids = prompt(n)
    want = run(full, ids, full.new_kv())
    slices = [load_slice(tiny, a, b) for a, b in even_split(full.cfg.num_hidden_layers, stages)]
    assert slices[0].has_embedding and not slices[0].has_head
    assert slices[-1].has_head and not slices[-1].has_embedding
    x = ids
    for s in slices:
        x = run(s, x, s.new_kv())
    assert x.shape == (n, full.cfg.hidden_size)
    # the same kernels on the same rows: bitwise equal, and so are the logits
    torch.testing.assert_close(x, want, atol=1e-5, rtol=0)
    assert torch.equal(x, want)
    assert torch.equal(slices[-1].logits(x), full.logits(want))


def test_slices_equal_full_model_through_decode(tiny, full):
    """Prefill then decode steps through a 3-way split track the full model step by step."""
    ids = prompt(40)
    slices = [load_slice(tiny, a, b) for a, b in even_split(4, 3)]
    kvs = [s.new_kv() for s in slices]
    kv_full = full.new_kv()
    for chunk in (ids[:20], ids[20:21], ids[21:30], ids[30:31], ids[31:]):
        want = run(full, chunk, kv_full)
        x = chunk
        for s, kv in zip(slices, kvs):
            x = run(s, x, kv)
        assert torch.equal(x, want)


# --- incremental decode -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 7, 33, 70])
def test_prefill_then_decode_matches_single_prefill(full, n):
    ids = prompt(n)
    whole = full.logits(run(full, ids, full.new_kv()))
    kv = full.new_kv()
    rows = [run(full, ids[:1], kv)]
    for i in range(1, n):
        rows.append(run(full, ids[i:i + 1], kv))
    assert kv.length == n
    stepped = full.logits(torch.cat(rows))
    torch.testing.assert_close(stepped[-1], whole[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stepped, whole, atol=1e-5, rtol=1e-5)   # every position, not only the last
    assert torch.equal(stepped.argmax(-1), whole.argmax(-1))


@pytest.mark.parametrize("cuts", [(5,), (1, 2), (10, 11, 30), (16, 32, 48)])
def test_chunked_prefill_matches_single_prefill(full, cuts):
    ids = prompt(60)
    whole = full.logits(run(full, ids, full.new_kv()))
    kv = full.new_kv()
    bounds = [0, *cuts, 60]
    rows = [run(full, ids[a:b], kv) for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(full.logits(torch.cat(rows)), whole, atol=1e-5, rtol=1e-5)


def test_plain_decode_does_not_read_past_the_cache_length(plain):
    """Garbage (NaN) in a cache's spare capacity is never read: outputs stay finite and unchanged."""
    ids = prompt(20)
    want = plain.logits(run(plain, ids, plain.new_kv()))
    kv = plain.new_kv()
    kv.ensure(200)
    poison(kv)
    got = [run(plain, ids[:12], kv)]
    for i in range(12, 20):
        got.append(run(plain, ids[i:i + 1], kv))
    got = plain.logits(torch.cat(got))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_paged_steps_scrub_what_a_failed_step_left(full):
    """A failed step may have written past what a request holds; the next step zeroes it before any block
    is read whole (a masked NaN key would still poison the sums)."""
    ids = prompt(20)
    want = full.logits(run(full, ids, full.new_kv()))
    kv = full.new_kv()
    kv.ensure(200)
    for t in (*kv.arena.k, *kv.arena.v):
        t.index_fill_(0, torch.tensor(kv.blocks), float("nan"))
    kv.written = 200            # as if a failed step had written up to there
    got = [run(full, ids[:12], kv)]
    for i in range(12, 20):
        got.append(run(full, ids[i:i + 1], kv))
    got = full.logits(torch.cat(got))
    assert torch.equal(got, want)


def test_paged_blocks_are_zeroed_when_handed_out_and_tagged(full):
    a = full.new_kv()
    run(full, prompt(70), a)
    used = list(a.blocks)
    a.release()
    b = full.new_kv()
    b.ensure(70)
    assert sorted(b.blocks) == sorted(used), "freed blocks are reused"
    assert all(bool((t == 0).all()) for t in held(b)), "a reused block shows nothing of its last holder"
    with pytest.raises(RuntimeError, match="owner tags"):
        a.arena.verify(torch.tensor(b.blocks), torch.full((len(b.blocks),), a.serial))


# --- micro-batches ----------------------------------------------------------------------------------------------


def _kv_rows(kv: KVCache, n: int) -> list[torch.Tensor]:
    return [t[:, :n].clone() for t in (*kv.k, *kv.v)]


@pytest.mark.parametrize("len_a,len_b", [(7, 12), (1, 33), (16, 16), (40, 1)])
def test_plain_two_requests_in_one_micro_batch_equal_alone(plain, len_a, len_b):
    a, b = prompt(len_a, seed=1), prompt(len_b, seed=2)
    alone_kv_a, alone_kv_b = plain.new_kv(), plain.new_kv()
    alone_a = plain.logits(run(plain, a, alone_kv_a))
    alone_b = plain.logits(run(plain, b, alone_kv_b))

    kv_a, kv_b = spy_kv(plain), spy_kv(plain)
    kv_a.ensure(len_a + 64)
    kv_b.ensure(len_b + 64)
    poison(kv_a)
    poison(kv_b)
    h = plain(torch.cat([a, b]), [SlotRows(kv_a, 0, len_a), SlotRows(kv_b, 0, len_b)])
    kv_a.length, kv_b.length = len_a, len_b
    batched = plain.logits(h)
    torch.testing.assert_close(batched[:len_a], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched[len_a:], alone_b, atol=1e-5, rtol=1e-5)

    # each cache was written only at its own rows, once per layer ...
    layers = range(plain.num_layers)
    assert kv_a.writes == [(i, 0, len_a) for i in layers]
    assert kv_b.writes == [(i, 0, len_b) for i in layers]
    # ... with exactly what it holds when run alone, and nothing past its own length
    for got, want in zip(_kv_rows(kv_a, len_a), _kv_rows(alone_kv_a, len_a)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for got, want in zip(_kv_rows(kv_b, len_b), _kv_rows(alone_kv_b, len_b)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for kv, n in ((kv_a, len_a), (kv_b, len_b)):
        for t in (*kv.k, *kv.v):
            assert torch.isnan(t[:, n:]).all(), "a write landed past the request's own rows"

    # a decode step of A batched with a decode step of B
    na, nb = torch.tensor([5]), torch.tensor([9])
    want_a = plain.logits(run(plain, na, alone_kv_a))
    want_b = plain.logits(run(plain, nb, alone_kv_b))
    kv_a.writes.clear()
    kv_b.writes.clear()
    h = plain(torch.cat([na, nb]), [SlotRows(kv_a, len_a, 1), SlotRows(kv_b, len_b, 1)])
    torch.testing.assert_close(plain.logits(h), torch.cat([want_a, want_b]), atol=1e-5, rtol=1e-5)
    assert kv_a.writes == [(i, len_a, 1) for i in layers]
    assert kv_b.writes == [(i, len_b, 1) for i in layers]


@pytest.mark.parametrize("len_a,len_b", [(7, 12), (1, 33), (16, 16), (40, 1), (64, 65)])
def test_paged_two_requests_in_one_micro_batch_equal_alone(full, len_a, len_b):
    a, b = prompt(len_a, seed=1), prompt(len_b, seed=2)
    alone_kv_a, alone_kv_b = full.new_kv(), full.new_kv()
    alone_a = full.logits(run(full, a, alone_kv_a))
    alone_b = full.logits(run(full, b, alone_kv_b))

    kv_a, kv_b = full.new_kv(), full.new_kv()
    kv_a.ensure(len_a + 64)
    kv_b.ensure(len_b + 64)
    rest = others(kv_a, kv_a.blocks + kv_b.blocks)
    h = full(torch.cat([a, b]), [SlotRows(kv_a, 0, len_a), SlotRows(kv_b, 0, len_b)])
    kv_a.length, kv_b.length = len_a, len_b
    batched = full.logits(h)
    assert torch.equal(batched[:len_a], alone_a) and torch.equal(batched[len_a:], alone_b)
    # each request's blocks hold exactly what they hold alone, zeros past its length; no other block moved
    for kv, alone, n in ((kv_a, alone_kv_a, len_a), (kv_b, alone_kv_b, len_b)):
        for got, want in zip(held(kv), held(alone)):
            flat_got, flat_want = got.transpose(1, 2).flatten(0, 1), want.transpose(1, 2).flatten(0, 1)
            assert torch.equal(flat_got[:n], flat_want[:n])
            assert (flat_got[n:] == 0).all()
    assert all(torch.equal(x, y) for x, y in zip(rest, others(kv_a, kv_a.blocks + kv_b.blocks)))

    # a decode step of A batched with a decode step of B, then A's decode next to a fresh prefill C
    na, nb = torch.tensor([5]), torch.tensor([9])
    want_a = full.logits(run(full, na, alone_kv_a))
    want_b = full.logits(run(full, nb, alone_kv_b))
    h = full(torch.cat([na, nb]), [SlotRows(kv_a, len_a, 1), SlotRows(kv_b, len_b, 1)])
    kv_a.length += 1
    kv_b.length += 1
    assert torch.equal(full.logits(h), torch.cat([want_a, want_b]))

    c = prompt(9, seed=3)
    want_c = full.logits(run(full, c, full.new_kv()))
    na2 = torch.tensor([77])
    want_a2 = full.logits(run(full, na2, alone_kv_a))
    kv_c = full.new_kv()
    kv_c.ensure(9)
    b_before = held(kv_b)
    h = full(torch.cat([c, na2]), [SlotRows(kv_c, 0, 9), SlotRows(kv_a, kv_a.length, 1)])
    got = full.logits(h)
    assert torch.equal(got[:9], want_c) and torch.equal(got[9:], want_a2)
    # B was not in that batch: its blocks are bit-for-bit as they were
    assert all(torch.equal(x, y) for x, y in zip(b_before, held(kv_b)))


def test_batch_of_many_requests_each_equal_alone(full):
    lengths = [3, 1, 17, 8, 1, 25]
    prompts = [prompt(n, seed=10 + i) for i, n in enumerate(lengths)]
    alone = [full.logits(run(full, p, full.new_kv()))[-1] for p in prompts]
    kvs = [full.new_kv() for _ in prompts]
    for kv, n in zip(kvs, lengths):
        kv.ensure(n)
    h = full(torch.cat(prompts), [SlotRows(kv, 0, n) for kv, n in zip(kvs, lengths)])
    ends = torch.tensor(lengths).cumsum(0) - 1
    batched = full.logits(h[ends])
    for i in range(len(prompts)):
        torch.testing.assert_close(batched[i], alone[i], atol=1e-5, rtol=1e-5)


# --- layer ranges -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers,stages,want", [
    (4, 1, [(0, 4)]),
    (4, 2, [(0, 2), (2, 4)]),
    (4, 3, [(0, 2), (2, 3), (3, 4)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (16, 5, [(0, 4), (4, 7), (7, 10), (10, 13), (13, 16)]),
    (1, 1, [(0, 1)]),
])
def test_even_split(layers, stages, want):
    got = even_split(layers, stages)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
    sizes = [e - s for s, e in got]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("layers,stages", [(4, 0), (4, 5), (4, -1), (0, 1)])
def test_even_split_refuses_impossible_splits(layers, stages):
    with pytest.raises(ValueError, match=f"cannot split {layers} layers into {stages} stages"):
        even_split(layers, stages)


def test_balanced_split_without_a_head_is_the_even_split():
    for layers in range(1, 41):
        for stages in range(1, layers + 1):
            assert balanced_split(layers, stages) == even_split(layers, stages), (layers, stages)


def _slowest(ranges: list[tuple[int, int]], head: float) -> float:
    return max([float(e - s) for s, e in ranges[:-1]] + [ranges[-1][1] - ranges[-1][0] + head])


@pytest.mark.parametrize("head", [0.0, 0.6, 1.5, 4.0, 9.0])
def test_balanced_split_makes_the_slowest_stage_as_fast_as_any_contiguous_split_can(head):
    """Against every contiguous split (each stage at least one layer) of up to 10 layers into up to 4 stages."""
    for layers in range(1, 11):
        for stages in range(1, min(layers, 4) + 1):
            got = balanced_split(layers, stages, head)
            assert got[0][0] == 0 and got[-1][1] == layers and all(a[1] == b[0] for a, b in zip(got, got[1:]))
            assert all(e > s for s, e in got)
            best = min(_slowest(list(zip((0, *cuts), (*cuts, layers))), head)
                       for cuts in itertools.combinations(range(1, layers), stages - 1))
            assert _slowest(got, head) == best, (layers, stages, head, got)


def test_the_default_model_gives_its_last_stage_fewer_layers_for_the_head():
    smollm2 = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=30, hidden_size=576, intermediate_size=1536,
                                  vocab_size=49152, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert head_cost(smollm2) == pytest.approx(4.0)
    assert balanced_split(30, 2, head_cost(smollm2)) == [(0, 17), (17, 30)]
    assert parse_layers("1/2", 30, head_cost(smollm2)) == (17, 30)
    assert head_cost(PRESETS["tiny"]) < 0.5   # a 272-token vocabulary: the even split
    assert balanced_split(4, 2, head_cost(PRESETS["tiny"])) == even_split(4, 2)


@pytest.mark.parametrize("spec,want", [
    ("0:4", (0, 4)), ("1:3", (1, 3)), (":", (0, 4)), (":2", (0, 2)), ("2:", (2, 4)), ("3:4", (3, 4)),
    ("0/1", (0, 4)), ("0/2", (0, 2)), ("1/2", (2, 4)), ("2/3", (3, 4)), ("3/4", (3, 4)),
])
def test_parse_layers(spec, want):
    assert parse_layers(spec, 4) == want


@pytest.mark.parametrize("spec", ["", "abc", "1", "1:2:3", "a:b", "1/", "/2", "2/2", "-1/2", "1/0", "1/2/3", "x/2"])
def test_parse_layers_syntax_errors(spec):
    with pytest.raises(ValueError, match="--layers must be START:END or I/N, got " + re.escape(repr(spec))):
        parse_layers(spec, 4)


@pytest.mark.parametrize("spec", ["0:5", "3:2", "2:2", "0:0", "-1:2", "4:", "5:6"])
def test_parse_layers_range_errors(spec):
    with pytest.raises(ValueError, match=r"the model has layers 0\.\.4"):
        parse_layers(spec, 4)


def test_model_slice_refuses_ranges_outside_the_model(full):
    for start, end in ((0, 0), (2, 1), (0, 5), (-1, 2)):
        with pytest.raises(ValueError, match="is not inside the model's 4 layers"):
            ModelSlice(full.cfg, start, end)


# --- loading ----------------------------------------------------------------------------------------------------


class _RecordingSafeOpen:
    """Wraps safetensors.safe_open and records which tensors were read."""

    def __init__(self, real, read: list[str]) -> None:
        self.real, self.read = real, read

    def __call__(self, *args, **kwargs):
        outer = self

        class Handle:
            def __enter__(self):
                self.h = outer.real(*args, **kwargs).__enter__()
                return self

            def __exit__(self, *exc):
                return self.h.__exit__(*exc)

            def keys(self):
                return self.h.keys()

            def get_tensor(self, name):
                outer.read.append(name)
                return self.h.get_tensor(name)

        return Handle()


@pytest.mark.parametrize("start,end", [(1, 3), (0, 1), (3, 4), (2, 3), (0, 4)])
def test_load_slice_reads_only_its_range(tiny, monkeypatch, start, end):
    read: list[str] = []
    monkeypatch.setattr(loader, "safe_open", _RecordingSafeOpen(loader.safe_open, read))
    m = load_slice(tiny, start, end)
    expected_layers = {f"model.layers.{i}." for i in range(start, end)}
    for name in read:
        if name.startswith("model.layers."):
            assert any(name.startswith(p) for p in expected_layers), f"read {name} outside [{start}, {end})"
    layer_names = {n for n in read if n.startswith("model.layers.")}
    assert {n.split(".")[2] for n in layer_names} == {str(i) for i in range(start, end)}
    assert len(read) == len(set(read))
    assert ("model.embed_tokens.weight" in read) == (start == 0)
    assert ("lm_head.weight" in read) == (end == 4)
    assert ("model.norm.weight" in read) == (end == 4)

    assert m.has_embedding == (start == 0) and m.has_head == (end == 4)
    assert (m.embed_tokens is not None) == (start == 0)
    assert hasattr(m, "lm_head") == (end == 4) and hasattr(m, "norm") == (end == 4)
    keys = set(m.state_dict())
    assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {str(i) for i in range(end - start)}
    if start > 0:
        assert not any(k.startswith("embed_tokens") for k in keys)
    if end < 4:
        assert not any(k.startswith(("lm_head", "norm.")) for k in keys)

    # local layer i holds the checkpoint's layer start + i
    ckpt = load_file(str(tiny / "model.safetensors"))
    for i in range(end - start):
        for part in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            got = m.state_dict()[f"layers.{i}.{part}"]
            assert torch.equal(got, ckpt[f"model.layers.{start + i}.{part}"])


def test_middle_slice_has_no_embedding_or_head(tiny):
    m = load_slice(tiny, 1, 3)
    assert m.embed_tokens is None and not m.has_embedding and not m.has_head
    assert not hasattr(m, "lm_head") and not hasattr(m, "norm")
    assert m.num_layers == 2 and (m.layer_start, m.layer_end) == (1, 3)
    assert all(k.startswith("layers.0.") or k.startswith("layers.1.") for k in m.state_dict())


def test_load_slice_needs_only_its_own_tensors(tiny, tmp_path):
    """A checkpoint missing layer 2 still serves slices that do not include it; slices that do are refused."""
    folder = tmp_path / "partial"
    folder.mkdir()
    shutil.copy(tiny / "config.json", folder / "config.json")
    w = load_file(str(tiny / "model.safetensors"))
    save_file({k: v for k, v in w.items() if not k.startswith("model.layers.2.")}, str(folder / "model.safetensors"))
    assert load_slice(folder, 0, 2).num_layers == 2
    assert load_slice(folder, 3, 4).has_head
    with pytest.raises(ValueError, match=r"checkpoint lacks \d+ tensors of layers \[2, 4\)"):
        load_slice(folder, 2, 4)


def test_load_slice_rejects_bad_dtype_and_missing_folder(tiny, tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_slice(tiny, dtype="int8")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_slice(tmp_path)
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "nowhere"))


# --- fingerprints and presets -----------------------------------------------------------------------------------


def _copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_fingerprint_changes_when_one_weight_byte_changes(tiny, tmp_path):
    original = model_fingerprint(tiny)
    copy = _copy_model(tiny, tmp_path / "copy")
    assert model_fingerprint(copy) == original            # path-independent
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01                                      # a low mantissa bit of the last weight
    weights.write_bytes(bytes(data))
    changed = model_fingerprint(copy)
    assert changed != original
    load_slice(copy)                                      # still a valid checkpoint: only the fingerprint tells
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    assert model_fingerprint(copy) == original


def test_fingerprint_binds_the_config_but_not_its_formatting(tiny, tmp_path):
    original = model_fingerprint(tiny)
    copy = _copy_model(tiny, tmp_path / "copy")
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(cfg, indent=None, sort_keys=False))
    assert model_fingerprint(copy) == original
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 2
    (copy / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(copy) != original


def test_generate_weights_is_deterministic_per_seed():
    cfg = PRESETS["tiny"]
    a, b = generate_weights(cfg, 123), generate_weights(cfg, 123)
    c = generate_weights(cfg, 124)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a)
    # names and shapes are what a Hugging Face Llama of this config holds
    assert a["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert a["model.layers.3.self_attn.k_proj.weight"].shape == (cfg.num_key_value_heads * cfg.head_dim,
                                                                 cfg.hidden_size)
    assert "model.layers.4.self_attn.q_proj.weight" not in a


def test_preset_generation_is_deterministic(tmp_path, monkeypatch):
    cfg = PRESETS["tiny"]
    prints = []
    for home in ("home_a", "home_b"):
        monkeypatch.setenv("TETHER_HOME", str(tmp_path / home))
        folder = ensure_preset("tiny")
        assert folder == preset_path("tiny") and folder.is_relative_to(tmp_path / home)
        assert ensure_preset("tiny") == folder             # second call reuses the folder
        prints.append(model_fingerprint(folder))
        assert ModelConfig.from_folder(folder) == cfg
    assert prints[0] == prints[1]

    # a different seed gives different weights and so a different fingerprint
    other = tmp_path / "other_seed"
    other.mkdir()
    shutil.copy(folder / "config.json", other / "config.json")
    save_file(generate_weights(cfg, 1), str(other / "model.safetensors"))
    assert model_fingerprint(other) != prints[0]


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="unknown preset"):
        ensure_preset("huge")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_a_linear_repacks_its_weight_when_the_weight_changes_or_is_replaced():
    """The packed copy (oneDNN's layout) follows the weight: a load into it (in place) or a new Parameter in
    its place is packed again, never answered from the old copy."""
    g = torch.Generator().manual_seed(3)
    lin = Linear(64, 96, bias=False).requires_grad_(False)
    lin.kernel = "onednn"
    x = torch.randn(3, 64, generator=g)
    assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight), atol=1e-5)
    lin.weight.copy_(torch.randn(96, 64, generator=g))            # what load_state_dict does
    assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight), atol=1e-5)
    for _ in range(3):   # a new weight, possibly at the old one's address once that is freed
        lin.weight = torch.nn.Parameter(torch.randn(96, 64, generator=g), requires_grad=False)
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.weight), atol=1e-5)
    lin.kernel = "mkl"
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
