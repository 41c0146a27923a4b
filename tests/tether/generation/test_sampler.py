"""Per-request sampling: greedy, seeded draws keyed by (seed, position), top-k / top-p, draw distance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.generation import sampler
from tether.reference import sampling_params

FAST = settings(max_examples=150, deadline=None, database=None)
V = 64


def logits_row(seed: int, scale: float = 3.0, n: int = V) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("seed", range(10))
def test_greedy_is_argmax(seed):
    row = logits_row(seed)
    for temperature in (0.0, -1.0):
        p = sampling_params(temperature=temperature, seed=seed, top_k=5, top_p=0.5)
        assert sampler.sample(row, p, position=seed) == int(row.argmax())


def test_greedy_ties_take_the_first_maximum():
    row = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0])
    assert sampler.sample(row, sampling_params(), 0) == 1
    assert sampler.sample(torch.zeros(10), sampling_params(), 3) == 0


def test_greedy_ignores_seed_and_position():
    row = logits_row(3)
    picks = {sampler.sample(row, sampling_params(seed=s), pos) for s in range(5) for pos in range(20)}
    assert picks == {int(row.argmax())}


def test_uniform_is_keyed_by_seed_and_position():
    u = sampler.uniform(7, 11)
    assert u == sampler.uniform(7, 11)
    assert 0.0 <= u < 1.0
    values = {sampler.uniform(s, p) for s in range(10) for p in range(10)}
    assert len(values) == 100
    assert sampler.uniform(1, 23) != sampler.uniform(12, 3)   # "1:23" vs "12:3" kept apart


def test_seeded_sampling_is_deterministic_per_seed_and_position():
    row = logits_row(1, scale=1.0)
    p = sampling_params(temperature=1.0, seed=42)
    first = [sampler.sample(row, p, pos) for pos in range(200)]
    assert first == [sampler.sample(row.clone(), p, pos) for pos in range(200)]
    assert len(set(first)) > 10                               # positions draw differently
    other_seed = [sampler.sample(row, sampling_params(temperature=1.0, seed=43), pos) for pos in range(200)]
    assert other_seed != first


def test_sampling_a_row_is_independent_of_other_rows():
    batch = torch.stack([logits_row(i, scale=1.0) for i in range(6)])
    params = [sampling_params(temperature=0.8 + 0.1 * i, seed=100 + i, top_k=i * 5, top_p=0.9) for i in range(6)]
    alone = [sampler.sample(batch[i].clone(), params[i], 50 + i) for i in range(6)]
    for trial in range(5):
        other = batch.clone()
        other[torch.arange(6) != 2] = torch.randn(5, V, generator=torch.Generator().manual_seed(trial)) * 5
        # row 2 sampled out of a different batch, and with its neighbours sampled first or not at all
        assert sampler.sample(other[2], params[2], 52) == alone[2]
    got = [sampler.sample(batch[i], params[i], 50 + i) for i in reversed(range(6))]
    assert got[::-1] == alone


def test_sampling_follows_the_distribution():
    """Inverse-CDF draws over many positions reproduce softmax(logits / T)."""
    row = torch.tensor([2.0, 1.0, 0.0, -1.0, 1.5])
    for temperature in (1.0, 0.5):
        p = sampling_params(temperature=temperature, seed=9)
        n = 4000
        counts = torch.bincount(torch.tensor([sampler.sample(row, p, pos) for pos in range(n)]), minlength=5)
        want = torch.softmax(row.double() / temperature, -1)
        for k in range(5):
            sd = math.sqrt(want[k] * (1 - want[k]) / n)
            assert abs(counts[k] / n - want[k]) < 5 * sd + 1e-3, (temperature, k, counts.tolist(), want.tolist())


@pytest.mark.parametrize("seed", range(8))
def test_top_k_1_equals_greedy(seed):
    row = logits_row(seed)
    p = sampling_params(temperature=1.5, seed=seed, top_k=1)
    assert {sampler.sample(row, p, pos) for pos in range(50)} == {int(row.argmax())}


@pytest.mark.parametrize("seed", range(8))
def test_tiny_top_p_equals_greedy(seed):
    row = logits_row(seed, scale=0.5)           # flat distribution: the top token has low mass
    p = sampling_params(temperature=2.0, seed=seed, top_p=1e-6)
    assert {sampler.sample(row, p, pos) for pos in range(50)} == {int(row.argmax())}


def test_top_k_restricts_to_the_k_largest():
    row = logits_row(5, scale=0.3)
    p = sampling_params(temperature=1.0, seed=1, top_k=4)
    allowed = set(torch.topk(row, 4).indices.tolist())
    picks = {sampler.sample(row, p, pos) for pos in range(400)}
    assert picks == allowed
    probs = sampler.filtered_probs(row, p)
    assert set(probs.nonzero().flatten().tolist()) == allowed
    assert abs(float(probs.sum()) - 1) < 1e-12


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    row = torch.log(torch.tensor([0.5, 0.05, 0.3, 0.15], dtype=torch.float64))
    probs = sampler.filtered_probs(row, sampling_params(temperature=1.0, top_p=0.7))
    # sorted: 0.5, 0.3 (cum 0.8 >= 0.7) -> keep tokens 0 and 2
    assert probs.nonzero().flatten().tolist() == [0, 2]
    torch.testing.assert_close(probs[[0, 2]], torch.tensor([0.5, 0.3], dtype=torch.float64) / 0.8)
    off = sampler.filtered_probs(row, sampling_params(temperature=1.0, top_p=1.0))
    assert (off > 0).all()


def test_sampled_token_is_always_in_range():
    row = torch.full((V,), -1e4)
    row[-1] = 0.0
    p = sampling_params(temperature=1.0, seed=0)
    assert {sampler.sample(row, p, pos) for pos in range(50)} == {V - 1}


@given(seed=st.integers(0, 2**63), position=st.integers(0, 10_000), logit_seed=st.integers(0, 10_000),
       temperature=st.floats(0.1, 2.0), top_k=st.integers(0, 70), top_p=st.floats(0.0, 1.0))
@FAST
def test_draw_distance_is_zero_for_the_sampled_token(seed, position, logit_seed, temperature, top_k, top_p):
    row = logits_row(logit_seed)
    p = sampling_params(temperature=temperature, seed=seed, top_k=top_k, top_p=top_p)
    tok = sampler.sample(row, p, position)
    assert 0 <= tok < V
    assert sampler.draw_distance(row, p, tok, position) == 0.0
    assert float(sampler.filtered_probs(row, p)[tok]) > 0      # never a filtered-out token


def test_draw_distance_is_positive_for_other_tokens():
    row = logits_row(11, scale=1.0)
    p = sampling_params(temperature=1.0, seed=5, top_k=10)
    tok = sampler.sample(row, p, 17)
    probs = sampler.filtered_probs(row, p)
    for other in range(V):
        d = sampler.draw_distance(row, p, other, 17)
        if other == tok:
            assert d == 0.0
        elif probs[other] == 0:
            assert d == float("inf")                          # filtered out entirely
        else:
            assert d > 0.0


# --- batched sampling: the last stage's micro-batch at once, the tokens of `sample` row by row ----------------

ROW_PARAMS = st.builds(lambda t, k, p, seed: sampling_params(temperature=t, top_k=k, top_p=p, seed=seed),
                       st.sampled_from([0.0, 0.05, 0.7, 1.0, 2.0]), st.sampled_from([0, 1, 3, 50, V, V + 7]),
                       st.sampled_from([0.0, 0.2, 0.9, 0.999, 1.0]), st.integers(0, 2**63 - 1))


@FAST
@given(rows=st.lists(st.tuples(ROW_PARAMS, st.integers(0, 8191), st.integers(0, 2**31),
                               st.sampled_from([0.1, 3.0, 30.0])), min_size=1, max_size=9),
       vocab=st.sampled_from([2, V, 1000]), ties=st.booleans())
def test_sample_rows_gives_the_tokens_of_sample_row_by_row(rows, vocab, ties):
    logits = torch.stack([logits_row(seed, scale, vocab) for _, _, seed, scale in rows])
    if ties:   # repeated values: first maximum, top-k cut-offs and sort order on equal values
        logits = logits.round()
    params = [p for p, _, _, _ in rows]
    positions = [pos for _, pos, _, _ in rows]
    want = [sampler.sample(logits[i], params[i], positions[i]) for i in range(len(rows))]
    assert sampler.sample_rows(logits, params, positions) == want


@FAST
@given(rows=st.lists(st.tuples(ROW_PARAMS, st.integers(0, 2**31), st.sampled_from([0.1, 3.0, 30.0])),
                     min_size=1, max_size=6),
       vocab=st.sampled_from([2, V, 1000, 5000]), ties=st.booleans())
def test_filtered_rows_are_filtered_probs_bit_for_bit(rows, vocab, ties):
    """The batched filter (top-k from one topk, top-p sorting only the largest entries) gives every row the
    very float64 probabilities of `filtered_probs` on that row alone: ties, a nucleus past the first 64
    candidates, top-k and top-p together."""
    rows = [r for r in rows if r[0].temperature > 0] or [(sampling_params(temperature=1.0, top_p=0.999), 1, 30.0)]
    logits = torch.stack([logits_row(seed, scale, vocab) for _, seed, scale in rows])
    if ties:
        logits = logits.round()
    params = [p for p, _, _ in rows]
    got = sampler.filtered_rows(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(got[i], sampler.filtered_probs(logits[i], p)), (p, vocab, ties)


def needs_c_kernels() -> None:
    if sampler._kernels() is None:
        pytest.skip("our C kernels are not built here")


@pytest.fixture(params=["C", "torch"])
def nucleus_path(request, monkeypatch):
    """Each whole-row nucleus test on both paths: the C kernel (tether/model/kernels/nucleus.c) and torch's."""
    if request.param == "torch":
        monkeypatch.setattr(sampler, "_kernels", lambda: None)
    else:
        needs_c_kernels()
    return request.param


def test_a_flat_nucleus_reaches_past_the_first_candidates_and_matches_the_whole_sort(nucleus_path):
    """Near-uniform logits: top-p 0.9 keeps ~90% of 49,152 entries, far past NUCLEUS_FIRST."""
    g = torch.Generator().manual_seed(11)
    row = torch.randn(49152, generator=g) * 0.01
    for top_p in (0.2, 0.9, 0.999):
        p = sampling_params(temperature=1.0, top_p=top_p)
        want = sampler.filtered_probs(row, p)
        assert int((want > 0).sum()) > 8 * sampler.NUCLEUS_FIRST
        assert torch.equal(sampler.filtered_rows(row[None], [p])[0], want)


@pytest.mark.parametrize("scale", [3.0, 1.5])
def test_a_nucleus_of_thousands_matches_the_whole_sort(scale, nucleus_path):
    """Past the first 64 candidates the floor is estimated from the row's mass by value: nuclei of ~2,000 and
    ~20,000 of 49,152 entries, ties among them, each top-p: the whole sort's probabilities bit for bit."""
    g = torch.Generator().manual_seed(17)
    tied = (torch.randn(49152, generator=g) * scale * 16).round() / 16   # values in sixteenths: many ties
    for row in (torch.randn(49152, generator=g) * scale, tied):
        for top_p in (0.5, 0.9, 0.99):
            p = sampling_params(temperature=1.0, top_p=top_p)
            want = sampler.filtered_probs(row, p)
            assert top_p < 0.9 or int((want > 0).sum()) > 8 * sampler.NUCLEUS_FIRST
            assert torch.equal(sampler.filtered_rows(row[None], [p])[0], want), (scale, top_p)


def test_a_floor_estimated_too_high_is_lowered_until_the_nucleus_is_whole(monkeypatch):
    """The estimate is only a guess: one that leaves the nucleus short (here: the largest entry) is lowered
    until the entries above it reach top-p, with the whole sort's answer (torch's path: the C kernel has its own)."""
    monkeypatch.setattr(sampler, "_kernels", lambda: None)
    monkeypatch.setattr(sampler, "_estimated_floor", lambda probs, top_p: float(probs.max()))
    row = torch.randn(49152, generator=torch.Generator().manual_seed(5)) * 2
    p = sampling_params(temperature=1.0, top_p=0.9)
    assert torch.equal(sampler.filtered_rows(row[None], [p])[0], sampler.filtered_probs(row, p))


def test_sample_rows_on_the_real_vocabulary(nucleus_path):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 49152, generator=g) * 6
    params = [sampling_params(temperature=t, top_k=k, top_p=p, seed=i)
              for i, (t, k, p) in enumerate([(0.7, 0, 0.0), (1.0, 40, 0.9), (0.0, 0, 0.0), (0.3, 0, 0.95),
                                              (1.3, 5, 0.0), (0.8, 0, 0.5), (0.0, 5, 0.5), (2.0, 49152, 1.0)])]
    positions = list(range(100, 108))
    assert sampler.sample_rows(logits, params, positions) == [
        sampler.sample(logits[i], params[i], positions[i]) for i in range(8)]


@pytest.mark.parametrize("threads", [2, 3])
def test_probabilities_do_not_follow_the_thread_count(threads):
    """torch splits a row's reductions across threads from 32,768 entries: sampling runs on one thread, so a row's
    probabilities are the same bits whatever the process's count, alone or beside others (without the pin, ~1 in 4
    of these rows differed between 1 and 2 threads)."""
    g = torch.Generator().manual_seed(threads)
    logits = torch.randn(4, 49152, generator=g) * 2
    params = [sampling_params(temperature=0.8, seed=1), sampling_params(temperature=1.0, top_p=0.9, seed=2),
              sampling_params(temperature=0.7, top_k=40, seed=3),
              sampling_params(temperature=0.9, top_k=400, top_p=0.95, seed=4)]
    before = torch.get_num_threads()
    try:
        got = {}
        for n in (1, threads):
            torch.set_num_threads(n)
            got[n] = ([sampler.filtered_probs(logits[i], p) for i, p in enumerate(params)],
                      sampler.filtered_rows(logits, params))
            assert torch.get_num_threads() == n   # restored after each call
        for alone_1, alone_n, batched_1, batched_n in zip(got[1][0], got[threads][0], got[1][1], got[threads][1]):
            for other in (alone_n, batched_1, batched_n):
                assert torch.equal(alone_1.view(torch.int64), other.view(torch.int64))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [2, 3])
def test_rows_drawn_on_several_threads_are_the_tokens_of_one(threads):
    """sample_rows(threads=N) splits the drawn rows in runs, each on its own thread: every token as `sample` gives
    it alone, greedy rows too, and the process's thread count restored."""
    g = torch.Generator().manual_seed(threads)
    rows = 19
    logits = torch.randn(rows, 49152, generator=g) * 3
    params = [sampling_params(temperature=[0.0, 0.6, 1.0, 1.3][i % 4], top_k=[0, 40, 0, 400][i % 4 // 2 * 2 + i % 2],
                              top_p=[0.0, 0.9, 0.5][i % 3], seed=i) for i in range(rows)]
    positions = list(range(50, 50 + rows))
    before = torch.get_num_threads()
    got = sampler.sample_rows(logits, params, positions, threads=threads)
    assert torch.get_num_threads() == before
    assert got == [sampler.sample(logits[i], params[i], positions[i]) for i in range(rows)]


# --- the C kernel's nucleus against torch's, entry for entry ------------------------------------------------

ROWS = st.sampled_from(["flat", "peaked", "ties", "tiny tail", "one", "zeros"])


def probability_row(kind: str, seed: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        x = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.05
    elif kind == "peaked":
        x = torch.randn(vocab, generator=g, dtype=torch.float64) * 6
    elif kind == "ties":   # few distinct values: equal entries on both sides of every cut, in index order
        x = torch.randint(0, 4, (vocab,), generator=g).double()
    elif kind == "tiny tail":   # most entries below the kernel's lowest bucket (2^-127): lumped, then sorted
        x = torch.full((vocab,), -200.0, dtype=torch.float64)
        x[torch.randint(0, vocab, (3,), generator=g)] = torch.tensor([0.0, -0.5, -1.0], dtype=torch.float64)
    elif kind == "one":
        x = torch.full((vocab,), -float("inf"), dtype=torch.float64)
        x[seed % vocab] = 0.0
    else:   # "zeros": a top-k row's shape, most entries exactly zero
        x = torch.full((vocab,), -float("inf"), dtype=torch.float64)
        x[torch.randint(0, vocab, (40,), generator=g)] = torch.randn(40, generator=g, dtype=torch.float64)
    return torch.softmax(x, dim=-1)


@FAST
@given(kind=ROWS, seed=st.integers(0, 2**31), vocab=st.sampled_from([3, 64, 1000, 49152]),
       top_p=st.sampled_from([1e-9, 0.2, 0.5, 0.9, 0.95, 0.999, 0.999999, 1 - 2**-40]))
def test_the_c_nucleus_keeps_the_entries_torch_keeps(kind, seed, vocab, top_p):
    """The same kept indices as torch's path and as the whole sort (`filtered_probs`' own definition), on rows
    where the kernel's bucket floor is exact, too low, or lumps the tail; ties across the cut; top-p a hair
    below 1 (the whole row)."""
    needs_c_kernels()
    probs = probability_row(kind, seed, vocab)
    got = sampler._native_kept(probs, top_p)
    assert got is not None
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    whole = torch.sort(order[(cum - sorted_p) < top_p]).values
    whole = whole[probs[whole] > 0]   # a kept zero is no entry: neither path returns one
    assert torch.equal(got, whole), (kind, vocab, top_p)
    assert torch.equal(got, sampler.nucleus_kept(probs, top_p, native_nucleus=False))


def test_the_c_nucleus_stays_in_bounds_on_values_no_softmax_gives():
    """NaN, infinities and -0.0 (a model gone wrong) are never read as bucket indices past the kernel's
    histogram: it returns indices of the row, nothing else (what they are is not defined)."""
    needs_c_kernels()
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1)
    probs[[3, 500, 999]] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=torch.float64)
    kept = sampler._native_kept(probs, 0.9)
    assert kept is not None and bool(((kept >= 0) & (kept < 1000)).all())
    assert torch.equal(kept, torch.sort(kept).values)


SPECIAL = st.sampled_from([0.0, -0.0, 1.0, -1.0, 3.5, float("inf"), float("-inf"), float("nan")])


def _tempered_in_torch(logits, params):
    kernels = sampler._kernels
    sampler._kernels = lambda: None
    try:
        return sampler._tempered(logits, params)
    finally:
        sampler._kernels = kernels


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs included (torch.equal calls no NaN equal)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int64), b.contiguous().view(torch.int64))


@FAST
@given(rows=st.lists(st.tuples(st.lists(st.one_of(SPECIAL, st.floats(-40, 40, width=32)), min_size=2, max_size=60),
                               st.sampled_from([0.05, 0.7, 1.0, 2.0]), st.integers(-1, 64)),
                     min_size=1, max_size=4), ties=st.booleans())
def test_the_c_temperature_and_top_k_are_torchs(rows, ties):
    """topk.c against torch's path of `_tempered`: the same doubles (NaN, infinities, -0.0 and ties across the
    k-th largest included: a NaN counts largest, as in torch.topk) and the same survivors, k from none to past
    the row."""
    needs_c_kernels()
    n = min(len(r) for r, _, _ in rows)
    logits = torch.tensor([r[:n] for r, _, _ in rows], dtype=torch.float32)
    if ties:
        logits = logits.round()
    params = [sampling_params(temperature=t, top_k=max(k, 0), seed=1) for _, t, k in rows]
    (x, within), (want_x, want_within) = sampler._tempered(logits, params), _tempered_in_torch(logits, params)
    assert same_bits(x, want_x)
    assert within.keys() == want_within.keys()
    for r in within:
        assert torch.equal(within[r], want_within[r]), r


@pytest.mark.parametrize("k", [1, 40, 1000, 49151])
def test_the_c_top_k_of_the_real_vocabulary(k):
    """The selection's three levels of buckets on 49,152 logits: a peaked row, a flat one, and one of few values
    (a bucket holding most of the row)."""
    needs_c_kernels()
    g = torch.Generator().manual_seed(k)
    rows = torch.stack([torch.randn(49152, generator=g) * 6, torch.randn(49152, generator=g) * 0.01,
                        torch.randint(0, 3, (49152,), generator=g).float()])
    params = [sampling_params(temperature=0.8, top_k=k, seed=1)] * 3
    (x, within), (want_x, want_within) = sampler._tempered(rows, params), _tempered_in_torch(rows, params)
    assert same_bits(x, want_x)
    for r in range(3):
        assert torch.equal(within[r], want_within[r]) and within[r].numel() >= k


@FAST
@given(rows=st.lists(st.lists(st.one_of(SPECIAL, st.floats(-4, 4, width=32)), min_size=1, max_size=40),
                     min_size=1, max_size=5), pick=st.lists(st.integers(0, 4), max_size=6))
def test_greedy_rows_in_c_are_torch_argmax_of_each_row(rows, pick):
    """argmax.c against torch.argmax of each row: the first maximum, the first NaN where there is one (torch
    counts NaN largest), +0 and -0 equal, rows picked in any order (repeats too) from a wider row stride."""
    needs_c_kernels()
    n = min(len(r) for r in rows)
    wide = torch.full((len(rows), n + 3), 99.0)   # the stride's extra columns hold a larger value no row may see
    for i, r in enumerate(rows):
        wide[i, :n] = torch.tensor(r[:n], dtype=torch.float32)
    logits = wide[:, :n]
    which = [p % len(rows) for p in pick] or list(range(len(rows)))
    assert sampler._first_maxima(logits, which) == [int(torch.argmax(logits[i])) for i in which]


def test_greedy_rows_out_of_range_are_refused_not_read():
    needs_c_kernels()
    logits = torch.randn(3, 40)
    for rows in ([3], [0, -1]):
        with pytest.raises(IndexError):
            sampler._first_maxima(logits, rows)
