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
