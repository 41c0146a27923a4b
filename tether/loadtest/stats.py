"""Pure statistics of a load level: percentiles, latency summaries, throughput, goodput, error counts.

Latencies are reported in milliseconds, throughputs per second of the level's wall time (from its start to
its last completion).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from tether.loadtest.records import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2e")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default).

    Rank q/100 * (n - 1) of the sorted values: p50 of [1, 2, 3, 4] is 2.5, p0 the minimum, p100 the maximum.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """count, mean and p50/p90/p99 of `values` times `scale`; None figures when there are no values."""
    xs = [v * scale for v in values]
    out: dict[str, float | int | None] = {"count": len(xs), "mean": sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(xs, q) if xs else None
    return out


def parse_slo(text: str) -> dict[str, float]:
    """'ttft:500,tpot:50' -> {'ttft': 500.0, 'tpot': 50.0} (milliseconds); metrics: ttft, tpot, e2e."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"SLO terms are METRIC:MILLISECONDS with METRIC one of {', '.join(SLO_METRICS)}; "
                             f"got {part!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {name} must be a number of milliseconds, got {value!r}") from None
        if not ms > 0:
            raise ValueError(f"SLO {name} must be positive, got {value!r}")
        slo[name] = ms
    if not slo:
        raise ValueError("empty SLO")
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """A completed request within every SLO; TPOT is vacuously met by a one-token answer (it has none)."""
    if not rec.ok:
        return False
    measured = {"ttft": rec.ttft, "tpot": rec.tpot, "e2e": rec.e2e}
    return all((v := measured[m]) is None or v * 1000 <= limit for m, limit in slo.items())


def level_summary(records: Sequence[RequestRecord], wall_s: float, slo: dict[str, float] | None) -> dict:
    """Throughput, goodput, latency distributions (ms) and errors by gRPC status of one load level."""
    done = [r for r in records if r.ok]
    per_s = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: None)
    starts = [r.start for r in records]
    span = max(starts) - min(starts) if starts else 0.0
    out_tokens = sum(r.output_tokens for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors_by_status": dict(sorted(Counter(r.error_code for r in records if not r.ok).items())),
        "wall_s": wall_s,
        # the rate requests actually went out at: a finite Poisson sample strays from its nominal rate
        "send_rate": (len(records) - 1) / span if span > 0 else None,
        "request_throughput": per_s(len(done)),
        "output_token_throughput": per_s(out_tokens),
        "input_token_throughput": per_s(sum(r.prompt_tokens for r in done)),
        "output_tokens": out_tokens,
        "goodput": per_s(sum(meets_slo(r, slo) for r in done)) if slo else None,
        "latency_ms": {
            "ttft": summarize((r.ttft for r in done if r.ttft is not None), 1000),
            "tpot": summarize((t for r in done if (t := r.tpot) is not None), 1000),
            "itl": summarize((g for r in done for g in r.itl), 1000),
            "e2e": summarize((r.e2e for r in done if r.e2e is not None), 1000),
        },
    }


def breakdown(records: Sequence[RequestRecord], key: Callable[[RequestRecord], str], wall_s: float,
              slo: dict[str, float] | None) -> dict[str, dict]:
    """`level_summary` per group of records (throughputs are each group's share of the level's wall time)."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r)
    return {name: level_summary(rs, wall_s, slo) for name, rs in sorted(groups.items())}


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)
