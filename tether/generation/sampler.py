"""Per-request sampling on the last stage (and in the reference).

A token depends only on the request's own logits row, its parameters, its seed and the position: the
uniform draw comes from a generator keyed by (seed, position), and the token is picked by inverse CDF in
vocabulary order. That makes the draw checkable after the fact (see `draw_interval`).
"""

from __future__ import annotations

import torch
import xxhash

from tether.v1 import common_pb2


def uniform(seed: int, position: int) -> float:
    g = torch.Generator().manual_seed(xxhash.xxh3_64_intdigest(f"{seed}:{position}".encode()) & ((1 << 63) - 1))
    return float(torch.rand((), generator=g, dtype=torch.float64))


def filtered_probs(logits: torch.Tensor, params: common_pb2.SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (float64, vocabulary order)."""
    x = logits.double() / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if 0 < params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop_sorted = (cum - sorted_p) >= params.top_p   # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: common_pb2.SamplingParams, position: int) -> int:
    """One token from one row of float logits; greedy (first maximum) when temperature is 0."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    cdf = torch.cumsum(filtered_probs(logits, params), dim=-1)
    u = uniform(params.seed, position) * float(cdf[-1])
    return min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)), logits.numel() - 1)


def draw_distance(logits: torch.Tensor, params: common_pb2.SamplingParams, token: int, position: int) -> float:
    """How far the draw fell outside `token`'s CDF interval (0 when the reference would pick it too).

    The teacher-forced audit accepts a sampled token whose interval misses the draw by less than float noise.
    """
    cdf = torch.cumsum(filtered_probs(logits, params), dim=-1)
    u = uniform(params.seed, position) * float(cdf[-1])
    low = float(cdf[token - 1]) if token > 0 else 0.0
    high = float(cdf[token])
    if high <= low:  # the token was filtered out entirely
        return float("inf")
    return max(low - u, u - high, 0.0)


# Candidates a nucleus (top-p) cut first looks at; past them, a floor estimated from the row's mass by value.
NUCLEUS_FIRST = 64
BUCKET_SHIFT = 48   # a float64's bits >> 48: its exponent and 4 mantissa bits, 16 buckets an octave, in value order


def _estimated_floor(probs: torch.Tensor, top_p: float) -> float:
    """A value such that the entries at or above it hold about `top_p` of the row's mass: the mass per bucket of
    values (the float64's exponent and top mantissa bits, which order like the values themselves), summed from
    the largest bucket down until it reaches top_p; the floor is that bucket's lower edge, one bucket lower for
    the float noise of these sums. Only a guess: `nucleus_drop` checks it exactly and lowers it when short."""
    # entries below 1e-30 (and zeros) share the lowest bucket
    keys = probs.clamp(min=1e-30).contiguous().view(torch.int64) >> BUCKET_SHIFT
    low = int(keys.min())
    mass = torch.bincount(keys - low, weights=probs)
    reached = torch.nonzero(torch.cumsum(mass.flip(0), 0) >= top_p).flatten()
    if reached.numel() == 0:
        return 0.0
    bucket = mass.numel() - 1 - int(reached[0]) + low - 1
    return float(torch.tensor([bucket << BUCKET_SHIFT]).view(torch.float64)[0])


def nucleus_drop(probs: torch.Tensor, top_p: float, first: float | None = None) -> torch.Tensor:
    """The entries of one row of probabilities [vocab] that top-p drops, exactly as `filtered_probs` finds them
    (a stable descending sort of the whole row, its cumulative sum) but sorting only the largest entries: every
    entry at or above a floor value are the first of that sort in the same order (a stable sort keeps index
    order among ties, and all of them come before every smaller entry), so their cumulative sums are the same
    floats (CPU cumsum adds in order), and once those reach top_p every later entry is dropped (adding
    non-negative floats never lowers a sum). The floor: the NUCLEUS_FIRST-th largest entry, else an estimate
    from the row's mass (`_estimated_floor`), halved until the entries above it reach top_p, or zero (every
    positive entry). 49,152 entries: ~20x faster than the whole sort for a peaked row, ~2-4x for a flat one.
    `first`: the NUCLEUS_FIRST-th largest entry where the caller found it already (`filtered_rows`, all rows in
    one topk)."""
    vocab = probs.numel()
    if first is None:
        first = float(torch.topk(probs, NUCLEUS_FIRST).values[-1]) if vocab > NUCLEUS_FIRST else 0.0
    floor, estimated = first, False
    while True:
        whole = floor <= 0
        # a zero floor: every positive entry is in; zeros sort last and stay zero whatever top-p says
        candidates = torch.nonzero(probs > 0 if whole else probs >= floor).flatten()
        values = probs[candidates]
        sorted_p, order = torch.sort(values, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        if whole or float(cum[-1]) >= top_p:
            drop = torch.ones(vocab, dtype=torch.bool)
            drop[candidates[order]] = (cum - sorted_p) >= top_p
            return drop
        floor = floor / 2 ** 4 if estimated else min(_estimated_floor(probs, top_p), floor)
        estimated = True
        if floor < 1e-300:
            floor = 0.0


def filtered_rows(logits: torch.Tensor, params: list[common_pb2.SamplingParams]) -> torch.Tensor:
    """`filtered_probs` of every row of `logits` [rows, vocab] with its own parameters (every temperature > 0),
    bit for bit, in a few batched ops: temperature and softmax over all rows at once, the top-k thresholds of the
    rows that have one from one `topk` of the largest k (the same values a sort gives), top-p by `nucleus_drop`."""
    vocab = logits.shape[-1]
    x = logits.double() / torch.tensor([p.temperature for p in params], dtype=torch.float64)[:, None]
    cut = [(r, p.top_k) for r, p in enumerate(params) if 0 < p.top_k < vocab]
    if cut:
        # the k-th largest value of each row that has a top-k (topk's last value): everything below it is out
        rows = torch.tensor([r for r, _ in cut])
        xs = x[rows]
        largest = torch.topk(xs, max(k for _, k in cut), dim=-1).values
        kth = largest.gather(1, torch.tensor([k - 1 for _, k in cut])[:, None])
        x[rows] = xs.masked_fill(xs < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    nucleus = [r for r, p in enumerate(params) if 0 < p.top_p < 1]
    if nucleus:
        firsts = torch.topk(probs[nucleus], NUCLEUS_FIRST, dim=-1).values[:, -1].tolist() \
            if vocab > NUCLEUS_FIRST else [0.0] * len(nucleus)
        for r, first in zip(nucleus, firsts):
            row = probs[r].masked_fill(nucleus_drop(probs[r], params[r].top_p, first), 0.0)
            probs[r] = row / row.sum()
    return probs


def sample_rows(logits: torch.Tensor, params: list[common_pb2.SamplingParams], positions: list[int]) -> list[int]:
    """`sample` for every row of `logits` [rows, vocab] with its own parameters and position, in a few batched
    ops instead of a dozen per row: the same tokens, bit for bit (the same float64 values on each row; tested
    against `sample` row by row). The last stage samples a micro-batch with it."""
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    if greedy:   # first maximum per row, as torch.argmax of one row
        for i, t in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
            tokens[i] = t
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if not drawn:
        return tokens
    vocab = logits.shape[-1]
    ps = [params[i] for i in drawn]
    cdf = torch.cumsum(filtered_rows(logits[drawn], ps), dim=-1)
    u = torch.tensor([uniform(p.seed, positions[i]) for p, i in zip(ps, drawn)], dtype=torch.float64)
    u = (u * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, u, right=True).clamp_(max=vocab - 1)[:, 0].tolist()
    for i, t in zip(drawn, picked):
        tokens[i] = t
    return tokens
