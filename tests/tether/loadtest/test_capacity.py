"""The capacity search on synthetic level outcomes, and what counts as meeting the SLO."""

from tether.loadtest.capacity import MAX_LEVELS, CapacitySearch, meets


def run(search: CapacitySearch, capacity: float) -> list[float]:
    rates = []
    while (rate := search.next_rate()) is not None:
        rates.append(rate)
        search.record(rate, rate <= capacity, "")
    return rates


def test_doubles_then_bisects_to_the_highest_rate_that_meets():
    s = CapacitySearch(start=1.0)
    rates = run(s, capacity=5.3)
    assert rates[:4] == [1.0, 2.0, 4.0, 8.0]            # doubling until 8 misses
    assert rates[4:] == [6.0, 5.0, 5.5]                  # three bisections between 4 and 8
    assert s.best == 5.0
    assert s.report(2)["per_pipeline"] == 2.5


def test_a_start_that_misses_halves_down_and_a_hopeless_cluster_ends():
    s = CapacitySearch(start=8.0)
    run(s, capacity=2.5)
    assert 2.0 <= s.best <= 2.5
    hopeless = CapacitySearch(start=1.0)
    rates = run(hopeless, capacity=0.0)
    assert hopeless.best is None and len(rates) <= MAX_LEVELS and min(rates) >= 1 / 16


def level(failed=0, mismatch=0, goodput=9.9, wall=10.0, requests=100, audited=True):
    """A level's summary and audit, as `meets` takes them."""
    return (dict(failed=failed, errors_by_status={}, goodput=goodput, wall_s=wall, requests=requests),
            dict(mismatch=mismatch) if audited else None)


def test_meets_needs_no_failure_no_mismatch_and_99_percent_within_the_slo():
    assert meets(*level())[0]
    assert not meets(*level(goodput=9.8))[0]
    assert not meets(*level(failed=1))[0]
    assert not meets(*level(mismatch=1))[0]
    assert "not audited" in meets(*level(audited=False))[1]


def test_find_capacity_needs_an_slo_and_runs_levels_for_a_time():
    import pytest

    from tether.loadtest.cli import build_parser, check_engine_args

    with pytest.raises(SystemExit, match="--slo"):
        check_engine_args(build_parser().parse_args(["--find-capacity"]))
    with pytest.raises(SystemExit, match="use --duration"):
        check_engine_args(build_parser().parse_args(["--find-capacity", "--slo", "ttft:500", "--num-requests", "9"]))
    args = build_parser().parse_args(["--find-capacity", "--slo", "ttft:500"])
    check_engine_args(args)
    assert args.audit and args.duration == 15.0
