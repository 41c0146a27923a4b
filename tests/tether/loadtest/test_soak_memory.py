"""The soak's memory verdict (bench/soak_watch.py, bench/soak_report.py): RSS at the start, after the warm-up and
at the end, and a failure when any service grows past the tolerance after the warm-up, whatever it did during it
(a KV pool or a heap filling in the first minute is not a leak; growth after it is)."""

from __future__ import annotations

from bench.soak_report import failures
from bench.soak_watch import RssSampler

MIB = 1024


def sampler(series: dict[str, list[int]], every: float = 2.0) -> RssSampler:
    """A sampler holding samples (MiB) taken every `every` s from t = 0."""
    s = RssSampler(pids={}, interval_s=every)
    s.samples = {name: [(i * every, mib * MIB) for i, mib in enumerate(values)] for name, values in series.items()}
    return s


def report(rss: dict[str, dict]) -> dict:
    return dict(requests=dict(by_class={"exact": 1}, refused_without_retry_info=0),
                rss=dict(tolerance=0.10, warmup_s=60.0, services=rss), services_exited=[],
                state_after=dict(drained=True))


def test_growth_during_the_warm_up_is_not_a_failure_but_growth_after_it_is():
    # 120 s of samples every 2 s: stage0 fills during the first minute then holds; stage1 keeps growing
    filling = [1000 + 8 * i for i in range(30)] + [1240] * 31
    creeping = [1000] * 30 + [1000 + 5 * i for i in range(31)]
    flat = sampler({"stage0": filling, "stage1": creeping}).flatness(0.0, 120.0, warmup_s=60.0)
    assert flat["stage0"]["start_mib"] == 1000 and flat["stage0"]["warm_mib"] == 1240
    assert flat["stage0"]["growth"] == 0.0 and flat["stage0"]["end_mib"] == 1240
    assert flat["stage1"]["warm_mib"] == 1005 and flat["stage1"]["end_mib"] == 1145
    assert round(flat["stage1"]["growth"], 3) == round(1145 / 1005 - 1, 3)
    fails = failures(report(flat))
    assert len(fails) == 1 and fails[0].startswith("stage1: RSS grew +13.9% after the warm-up"), fails


def test_one_sample_taken_mid_allocation_does_not_decide():
    spiky = [1000] * 40 + [1500] + [1000] * 20
    flat = sampler({"admission": spiky}).flatness(0.0, 120.0, warmup_s=60.0)
    assert flat["admission"]["growth"] == 0.0 and not failures(report(flat))


def test_a_short_run_takes_its_first_third_as_the_warm_up_and_too_few_samples_fail():
    flat = sampler({"coordinator": [64] * 16}).flatness(0.0, 30.0, warmup_s=60.0)
    assert flat["coordinator"]["growth"] == 0.0
    few = sampler({"coordinator": [64, 64]}).flatness(0.0, 4.0, warmup_s=60.0)
    assert few["coordinator"]["growth"] is None
    assert failures(report(few)) == ["coordinator: too few RSS samples after the warm-up to compare"]
