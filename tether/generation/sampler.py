"""Per-request sampling on the last stage (and in the reference).

A token depends only on the request's own logits row, its parameters, its seed and the position: the
uniform draw comes from a generator keyed by (seed, position), and the token is picked by inverse CDF in
vocabulary order. That makes the draw checkable after the fact (see `draw_interval`).

Every entry point runs torch on one thread (`invariant.one_thread`): from 32,768 entries torch splits a row's
reductions (softmax's sum, top-p's renormalising sum) across its threads, so a row's probabilities followed the
process's thread count and, on more than one, whether the row was sampled alone or beside others (smollm2's
49,152 logits: 102 of 400 rows differed between 1 and 2 threads). A stage's token then depended on its
`--threads`; now it is the same bits everywhere.
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor, wait

import torch
import xxhash

from tether.model.invariant import one_thread
from tether.v1 import common_pb2


def uniform(seed: int, position: int) -> float:
    g = torch.Generator().manual_seed(xxhash.xxh3_64_intdigest(f"{seed}:{position}".encode()) & ((1 << 63) - 1))
    return float(torch.rand((), generator=g, dtype=torch.float64))


@one_thread()
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


@one_thread()
def sample(logits: torch.Tensor, params: common_pb2.SamplingParams, position: int) -> int:
    """One token from one row of float logits; greedy (first maximum) when temperature is 0."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    cdf = torch.cumsum(filtered_probs(logits, params), dim=-1)
    u = uniform(params.seed, position) * float(cdf[-1])
    return min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)), logits.numel() - 1)


@one_thread()
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
    the float noise of these sums. Only a guess: `nucleus_kept` checks it exactly and lowers it when short."""
    # entries below 1e-30 (and zeros) share the lowest bucket
    keys = probs.clamp(min=1e-30).contiguous().view(torch.int64) >> BUCKET_SHIFT
    low = int(keys.min())
    mass = torch.bincount(keys - low, weights=probs)
    reached = torch.nonzero(torch.cumsum(mass.flip(0), 0) >= top_p).flatten()
    if reached.numel() == 0:
        return 0.0
    bucket = mass.numel() - 1 - int(reached[0]) + low - 1
    return float(torch.tensor([bucket << BUCKET_SHIFT]).view(torch.float64)[0])


@functools.lru_cache(maxsize=1)
def _kernels() -> ctypes.CDLL | None:
    from tether.model import native   # the model's kernel library, built once per machine
    return native.library() if native.available() is None else None


def _native_kept(probs: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """`nucleus_kept` of a whole row by tether/model/kernels/nucleus.c (the same entries: its bucket floor and
    radix sort in one pass each), or None where the kernels are not built here (or the row is not float64)."""
    lib = _kernels()
    if lib is None or probs.dtype != torch.float64 or probs.dim() != 1:
        return None
    probs = probs.contiguous()
    out = torch.empty(probs.numel(), dtype=torch.int64)
    n = lib.nucleus_keep(probs.data_ptr(), probs.numel(), top_p, out.data_ptr())
    return out[:n] if n >= 0 else None


def nucleus_kept(probs: torch.Tensor, top_p: float, first: float | None = None,
                 within: torch.Tensor | None = None, native_nucleus: bool = True) -> torch.Tensor:
    """The indices (ascending) of the entries of one row of probabilities [vocab] that top-p keeps, exactly as
    `filtered_probs` finds them (a stable descending sort of the whole row, its cumulative sum) but sorting only
    the largest entries: every entry at or above a floor value are the first of that sort in the same order (a
    stable sort keeps index order among ties, and all of them come before every smaller entry), so their
    cumulative sums are the same floats (CPU cumsum adds in order), and once those reach top_p every later entry
    is dropped (adding non-negative floats never lowers a sum). Any floor is exact; a good one is only faster:
    the NUCLEUS_FIRST-th largest entry, else an estimate of where the row's mass reaches top_p
    (`_estimated_floor`), lowered until the entries above it reach top_p, or zero (every positive entry).
    `first`: a floor the caller found already (`_kept_rows`: the entry at the NUCLEUS_FIRST-th largest logit).
    `within`: ascending indices holding every positive entry (a top-k row's survivors), sorted alone.
    A whole row goes to the C kernel where it is built (`_native_kept`; `native_nucleus=False`: torch's path,
    for the tests that hold the two equal)."""
    if within is None and native_nucleus:
        kept = _native_kept(probs, top_p)
        if kept is not None:
            return kept
    candidates: torch.Tensor | None = within
    if within is not None:
        floor, estimated = 0.0, True
    else:
        if first is None:
            first = float(torch.topk(probs, NUCLEUS_FIRST).values[-1]) if probs.numel() > NUCLEUS_FIRST else 0.0
        floor, estimated = first, False
    while True:
        whole = floor <= 0
        # a zero floor: every positive entry is in; zeros sort last and stay zero whatever top-p says
        if candidates is None:
            candidates = torch.nonzero(probs > 0 if whole else probs >= floor).flatten()
        values = probs[candidates]
        sorted_p, order = torch.sort(values, descending=True, stable=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        if whole or float(cum[-1]) >= top_p:
            keep = torch.empty_like(order, dtype=torch.bool)
            keep[order] = (cum - sorted_p) < top_p
            return candidates[keep]   # ascending, as `candidates` are
        floor = floor / 2 ** 4 if estimated else min(_estimated_floor(probs, top_p), floor)
        estimated, candidates = True, None
        if floor < 1e-300:
            floor = 0.0


Kept = tuple[torch.Tensor | None, torch.Tensor]   # (ascending indices, their probabilities), or (None, whole row)


def _kept_rows(logits: torch.Tensor, params: list[common_pb2.SamplingParams]) -> list[Kept]:
    """`filtered_probs` of every row of `logits` [rows, vocab] with its own parameters (every temperature > 0),
    bit for bit, as the entries each row keeps: (indices, float64 probabilities), or (None, the whole row) where
    nothing is filtered. Temperature and softmax over all rows at once, the rest only where an entry can be kept:
    - top-k's k-th largest value: x at the k-th largest logit (x = logits / T does not decrease as the logit
      grows, so that is the k-th largest x), the survivors those at or above it (`_tempered`);
    - top-p by `nucleus_kept` (a whole row in C where the kernels are built; in torch its first floor the
      probability at the NUCLEUS_FIRST-th largest logit: any floor is exact), a top-k row's survivors sorted alone;
    - top-p's renormalising sum over the whole row with the dropped entries zero, as `filtered_probs` takes it
      (the same reduction of the same floats), each kept entry divided by it (a division rounds per entry)."""
    vocab = logits.shape[-1]
    x, within = _tempered(logits, params)
    probs = torch.softmax(x, dim=-1)
    nucleus = [r for r, p in enumerate(params) if 0 < p.top_p < 1]
    wide = [r for r in nucleus if r not in within]
    firsts: dict[int, float] = {}
    if wide and vocab > NUCLEUS_FIRST and _kernels() is None:   # torch's path starts from them; the C kernel need not
        top = torch.topk(logits[wide], NUCLEUS_FIRST, dim=-1).indices
        firsts = {r: float(probs[r, top[i]].min()) for i, r in enumerate(wide)}
    out: list[Kept] = []
    row = torch.zeros(vocab if nucleus else 0, dtype=torch.float64)   # one zeroed row for all: set, summed, reset
    for r, p in enumerate(params):
        if r in nucleus:
            first = firsts.get(r, 0.0 if vocab <= NUCLEUS_FIRST else None)
            kept = nucleus_kept(probs[r], p.top_p, first, within.get(r))
            row[kept] = probs[r, kept]
            out.append((kept, row[kept] / row.sum()))
            row[kept] = 0.0
        elif r in within:
            out.append((within[r], probs[r, within[r]]))
        else:
            out.append((None, probs[r]))
    return out


def _tempered(logits: torch.Tensor,
              params: list[common_pb2.SamplingParams]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """x = logits / T in float64 for every row [rows, vocab], each top-k row's entries below its k-th largest
    x set to -inf, and those rows' survivors (ascending indices). In C where the kernels are built
    (tether/model/kernels/topk.c: two passes a row, into one buffer), else torch's topk, comparison, fill and
    nonzero; the same doubles either way (a cast and an IEEE division; only comparisons besides)."""
    vocab = logits.shape[-1]
    within: dict[int, torch.Tensor] = {}
    lib = _kernels()
    if lib is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
        x = torch.empty(logits.shape, dtype=torch.float64)
        for r, p in enumerate(params):
            k = p.top_k if 0 < p.top_k < vocab else 0
            kept = torch.empty(vocab if k else 0, dtype=torch.int64)
            n = lib.temper_top_k(logits[r].data_ptr(), vocab, p.temperature, k, x[r].data_ptr(),
                                 kept.data_ptr() if k else None)
            if k:
                within[r] = kept[:n]
        return x, within
    x = logits.double() / torch.tensor([p.temperature for p in params], dtype=torch.float64)[:, None]
    cut = [r for r, p in enumerate(params) if 0 < p.top_k < vocab]
    if cut:
        at = torch.topk(logits[cut], max(params[r].top_k for r in cut), dim=-1).indices
        for i, r in enumerate(cut):
            drop = x[r] < x[r, at[i, params[r].top_k - 1]]
            x[r].masked_fill_(drop, float("-inf"))
            within[r] = torch.nonzero(~drop).flatten()
    return x, within


@one_thread()
def filtered_rows(logits: torch.Tensor, params: list[common_pb2.SamplingParams]) -> torch.Tensor:
    """`filtered_probs` of every row of `logits` [rows, vocab] with its own parameters (every temperature > 0),
    bit for bit, as one tensor: `_kept_rows` with the dropped entries zero."""
    out = torch.zeros(logits.shape, dtype=torch.float64)
    for r, (kept, p) in enumerate(_kept_rows(logits, params)):
        if kept is None:
            out[r] = p
        else:
            out[r, kept] = p
    return out


def _first_maxima(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """torch.argmax of each of `logits`' rows `rows` (the first maximum; the first NaN where there is one): in C
    where the kernels are built (argmax.c, reading the rows in place), else torch on the rows gathered."""
    if not rows:
        return []
    if min(rows) < 0 or max(rows) >= logits.shape[0]:   # the C loop reads them unchecked
        raise IndexError(f"rows {min(rows)}..{max(rows)} of logits with {logits.shape[0]} rows")
    lib = _kernels()
    if lib is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        return logits[rows].argmax(dim=-1).tolist()
    which = torch.tensor(rows, dtype=torch.int64)
    out = torch.empty(len(rows), dtype=torch.int64)
    lib.rows_argmax(logits.data_ptr(), logits.shape[1], logits.stride(0), which.data_ptr(), len(rows), out.data_ptr())
    return out.tolist()


@one_thread()
def sample_rows(logits: torch.Tensor, params: list[common_pb2.SamplingParams], positions: list[int],
                threads: int = 1) -> list[int]:
    """`sample` for every row of `logits` [rows, vocab] with its own parameters and position: the same tokens,
    bit for bit (tested against `sample` row by row). The last stage samples a micro-batch with it. `sample`
    searches the cumulative sum of the whole filtered row; here the kept entries' alone: a dropped entry adds an
    exact zero, and the first entry whose sum passes the draw is a kept one (the sum rises only there).
    `threads` > 1: the drawn rows split in that many runs, each sampled on its own thread (every row's torch still
    on one: the same bits), for a micro-batch alone in the pipeline, whose other stages' cores are idle."""
    tokens = [0] * len(params)
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    for i, t in zip(greedy, _first_maxima(logits, greedy)):
        tokens[i] = t
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    runs = min(threads, len(drawn) // ROWS_PER_THREAD)
    if runs <= 1:
        _draw(logits, params, positions, drawn, tokens)
        return tokens
    cut = [len(drawn) * t // runs for t in range(runs + 1)]
    pool = _pool(runs - 1)
    helpers = [pool.submit(_draw_pinned, logits, params, positions, drawn[cut[t]:cut[t + 1]], tokens)
               for t in range(1, runs)]
    try:
        _draw(logits, params, positions, drawn[:cut[1]], tokens)
    finally:
        wait(helpers)   # none left writing into `tokens` or reading `logits` once this returns or raises
    for h in helpers:
        h.result()      # a helper's exception, raised here
    return tokens


ROWS_PER_THREAD = 2   # the fewest drawn rows a run takes: a handoff to a helper costs 0.1-0.3 ms, a row 0.2-0.5


@functools.lru_cache(maxsize=None)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="sample")


def _draw_pinned(logits: torch.Tensor, params: list[common_pb2.SamplingParams], positions: list[int],
                 drawn: list[int], tokens: list[int]) -> None:
    """`_draw` on a helper thread: its own OpenMP count pinned to one (a thread's count is its own; the process's
    is one already, inside sample_rows)."""
    torch.set_num_threads(1)
    _draw(logits, params, positions, drawn, tokens)


def _draw(logits: torch.Tensor, params: list[common_pb2.SamplingParams], positions: list[int], drawn: list[int],
          tokens: list[int]) -> None:
    """tokens[i] for each row i of `drawn` (temperature > 0)."""
    if not drawn:
        return
    vocab = logits.shape[-1]
    ps = [params[i] for i in drawn]
    rows = logits if len(drawn) == logits.shape[0] else logits.index_select(0, torch.tensor(drawn))
    for i, p, (kept, probs) in zip(drawn, ps, _kept_rows(rows, ps)):
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.tensor([uniform(p.seed, positions[i]) * float(cdf[-1])], dtype=torch.float64)
        j = int(torch.searchsorted(cdf, u, right=True))
        tokens[i] = vocab - 1 if j >= cdf.numel() else (j if kept is None else int(kept[j]))
