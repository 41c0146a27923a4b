"""`tether bench --find-capacity`: the highest request rate a cluster serves within an SLO with zero audit
mismatches (pure search logic; the levels themselves are ordinary open-loop levels of the bench).

A level *meets* the SLO when no request failed, the audit found no mismatch, and at least `MIN_GOOD` of its
requests met every SLO bound (TTFT, TPOT). The search doubles the rate from its start until a level misses,
then bisects between the best rate that met and the lowest that missed, `BISECTIONS` times. The capacity
per pipeline is the result divided by the pipelines behind admission: what sizing the number of pipelines
for a target rate starts from (docs/PERFORMANCE.md, "Capacity planning").
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_GOOD = 0.99        # share of a level's requests that must meet the SLO
LEVEL_S = 15.0         # each level's length unless --duration says otherwise: long enough for a queue to build
BISECTIONS = 3
MAX_LEVELS = 12        # the search stops here whatever it found: every level costs a full load run


def meets(summary: dict, audit: dict | None, min_good: float = MIN_GOOD) -> tuple[bool, str]:
    """Whether one level meets the SLO, from its summary (stats.level_summary) and audit (None: not audited),
    and why not."""
    s = summary
    if s["failed"]:
        return False, f"{s['failed']} request(s) failed ({s['errors_by_status']})"
    if audit is None:
        return False, "not audited"
    if audit["mismatch"]:
        return False, f"{audit['mismatch']} audit mismatch(es)"
    if not s["requests"] or s["goodput"] is None:
        return False, "no SLO given or no requests"
    good = s["goodput"] * s["wall_s"] / s["requests"]
    if good < min_good - 1e-9:
        return False, f"{good:.1%} of requests met the SLO (< {min_good:.0%})"
    return True, f"{good:.1%} of requests met the SLO, 0 mismatches"


@dataclass
class CapacitySearch:
    start: float
    bisections: int = BISECTIONS
    tried: list[tuple[float, bool, str]] = field(default_factory=list)

    @property
    def best(self) -> float | None:
        """The highest rate that met the SLO so far."""
        good = [r for r, ok, _ in self.tried if ok]
        return max(good) if good else None

    def next_rate(self) -> float | None:
        """The next rate to try, or None when the search is done."""
        if len(self.tried) >= MAX_LEVELS:
            return None
        if not self.tried:
            return self.start
        missed = [r for r, ok, _ in self.tried if not ok]
        best = self.best
        if not missed:
            return self.tried[-1][0] * 2
        low = min(missed)
        if best is None:                    # even the start missed: halve down, a few times
            return low / 2 if low / 2 >= self.start / 16 else None
        first_miss = next(i for i, (_, ok, _) in enumerate(self.tried) if not ok)
        if len(self.tried) - first_miss - 1 >= self.bisections or low - best < 0.05 * best:
            return None
        return round((best + low) / 2, 3)

    def record(self, rate: float, ok: bool, why: str) -> None:
        self.tried.append((rate, ok, why))

    def report(self, pipelines: int) -> dict:
        best = self.best
        return dict(capacity_rate=best, per_pipeline=None if best is None else best / pipelines,
                    pipelines=pipelines, min_good=MIN_GOOD,
                    levels=[dict(rate=r, meets=ok, why=why) for r, ok, why in self.tried])
