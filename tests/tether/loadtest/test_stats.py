"""Statistics of a load level: percentiles, summaries, SLO parsing, goodput and per-group breakdowns."""

from __future__ import annotations

import random

import pytest

from tether.loadtest import stats
from tether.loadtest.records import RequestRecord
from tether.loadtest.workloads import BenchRequest


def record(ttft: float | None = 0.1, e2e: float | None = 1.0, n: int = 11, error: str = "", workload: str = "single",
           itl: list[float] | None = None, tags: dict | None = None, prompt_tokens: int = 5) -> RequestRecord:
    r = RequestRecord(BenchRequest(0, workload, "p", 16), "level")
    r.ttft, r.e2e, r.token_ids = ttft, e2e, list(range(n))
    r.itl = itl if itl is not None else [0.09] * max(0, n - 1)
    r.error_code, r.tags, r.prompt_tokens = error, tags or {}, prompt_tokens
    return r


@pytest.mark.parametrize("q,want", [(0, 1), (25, 1.75), (50, 2.5), (90, 3.7), (99, 3.97), (100, 4)])
def test_percentile_interpolates_linearly_between_ranks(q, want):
    assert stats.percentile([4, 1, 3, 2], q) == pytest.approx(want)


def test_percentile_matches_numpy_linear_on_random_data():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_refuses_empty_input_and_bad_q():
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


def test_summarize_scales_and_handles_no_values():
    s = stats.summarize([0.1, 0.2, 0.3], scale=1000)
    assert s["count"] == 3 and s["mean"] == pytest.approx(200) and s["p50"] == pytest.approx(200)
    assert s["p99"] == pytest.approx(298)
    assert stats.summarize([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_parse_slo():
    assert stats.parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert stats.parse_slo(" e2e:2000 ") == {"e2e": 2000.0}
    for bad in ("", "ttft", "itl:5", "ttft:abc", "ttft:0", "ttft:-1"):
        with pytest.raises(ValueError):
            stats.parse_slo(bad)


def test_tpot_is_time_after_the_first_token_per_later_token():
    assert record(ttft=0.1, e2e=1.1, n=11).tpot == pytest.approx(0.1)
    assert record(n=1).tpot is None                    # one token: no time per output token
    assert record(error="ABORTED").tpot is None


def test_meets_slo_checks_every_metric_and_one_token_answers_have_no_tpot():
    slo = {"ttft": 200.0, "tpot": 100.0}
    assert stats.meets_slo(record(ttft=0.1, e2e=1.1, n=11), slo)          # tpot 100 ms: on the line
    assert not stats.meets_slo(record(ttft=0.3, e2e=1.3, n=11), slo)      # ttft 300 ms
    assert not stats.meets_slo(record(ttft=0.1, e2e=2.1, n=11), slo)      # tpot 200 ms
    assert stats.meets_slo(record(ttft=0.1, e2e=0.1, n=1), slo)
    assert not stats.meets_slo(record(error="UNAVAILABLE"), slo)
    assert not stats.meets_slo(record(ttft=0.1, e2e=3.0), {"e2e": 2000.0})


def test_level_summary_throughput_goodput_and_errors():
    failed = [record(error=code, ttft=None, e2e=None) for code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "UNAVAILABLE")]
    records = [record(ttft=0.1, e2e=1.1), record(ttft=0.5, e2e=1.5), *failed]
    s = stats.level_summary(records, wall_s=2.0, slo={"ttft": 200.0})
    assert (s["requests"], s["completed"], s["failed"]) == (5, 2, 3)
    assert s["errors_by_status"] == {"RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 2}
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_token_throughput"] == pytest.approx(11.0)       # 22 tokens of completed requests / 2 s
    assert s["input_token_throughput"] == pytest.approx(5.0)
    assert s["goodput"] == pytest.approx(0.5)                        # only the 100 ms TTFT one
    lat = s["latency_ms"]
    assert lat["ttft"]["count"] == 2 and lat["ttft"]["p50"] == pytest.approx(300)
    assert lat["itl"]["count"] == 20 and lat["itl"]["p99"] == pytest.approx(90)
    assert stats.level_summary(records, 2.0, None)["goodput"] is None
    for i, r in enumerate(records):
        r.start = 0.25 * i
    assert stats.level_summary(records, 2.0, None)["send_rate"] == pytest.approx(4.0)   # 4 gaps in 1 s


def test_breakdown_groups_by_key():
    records = [record(workload="single"), record(workload="long"), record(workload="long", error="ABORTED")]
    groups = stats.breakdown(records, lambda r: r.request.workload, 1.0, None)
    assert list(groups) == ["long", "single"]
    assert (groups["long"]["requests"], groups["long"]["failed"]) == (2, 1)
    by_limit = stats.breakdown([record(tags={"length_limit": 50}), record(tags={"length_limit": 0}), record(error="X")],
                               lambda r: r.tag("length_limited"), 1.0, None)
    assert {k: v["requests"] for k, v in by_limit.items()} == {"no": 1, "unknown": 1, "yes": 1}
