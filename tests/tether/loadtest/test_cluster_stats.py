"""Engine figures of `tether bench`: /proc parsing, Stats deltas and ratios, process CPU, the prefix-cache
comparison, the flags a spawned cluster gets, the shared-doc workload and the report's engine sections."""

from __future__ import annotations

import os

import pytest

from tether.loadtest import cluster_stats, report, stats
from tether.loadtest.chaos import not_requested
from tether.loadtest.cli import build_parser, check_engine_args, cluster_extra, offered_context, print_summary
from tether.loadtest.records import RequestRecord
from tether.loadtest.workloads import SHARED_DOC_QUESTIONS, BenchRequest, SharedDocSpec, Workload, parse_mix


def coordinator(**over) -> dict:
    base = {k: 0 for k in cluster_stats.COORDINATOR_COUNTERS + cluster_stats.COORDINATOR_GAUGES}
    return {**base, "address": "127.0.0.1:2", "rejections": {}, **over}


def stage(**over) -> dict:
    base = {k: 0 for k in cluster_stats.STAGE_COUNTERS + cluster_stats.STAGE_GAUGES}
    return {**base, "address": "127.0.0.1:3", "rejections": {}, **over}


# --- /proc ---------------------------------------------------------------------------------------------------------

def test_parse_proc_stat_counts_fields_after_the_command_name():
    # a command name with spaces and a ')' must not shift the fields: utime 250, stime 50 ticks
    text = "4242 (python (x) y) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 3 0 1000 1 1\n"
    assert cluster_stats.parse_proc_stat(text, 100) == pytest.approx(3.0)


def test_this_process_cpu_and_rss_are_read():
    assert cluster_stats.proc_cpu_s(os.getpid()) is not None and cluster_stats.proc_rss_kib(os.getpid()) > 0
    assert cluster_stats.self_cpu_s() > 0
    assert cluster_stats.proc_cpu_s(2**22 + 12345) is None and cluster_stats.proc_rss_kib(2**22 + 12345) is None


def test_parse_pids():
    assert cluster_stats.parse_pids("stage0=12, admission=34") == {"stage0": 12, "admission": 34}
    for bad in ("stage0", "=12", "stage0=x"):
        with pytest.raises(ValueError):
            cluster_stats.parse_pids(bad)


def test_cpu_delta_is_cpu_over_wall_with_exited_processes_unknown():
    before = dict(wall=10.0, cpu={"stage0": 1.0, "gone": 5.0, "bench": 2.0}, rss_kib={})
    after = dict(wall=14.0, cpu={"stage0": 3.0, "gone": None, "bench": 2.4},
                 rss_kib={"stage0": 2048, "gone": None, "bench": 1024})
    d = cluster_stats.cpu_delta(before, after)
    assert d["wall_s"] == 4.0
    assert d["processes"]["stage0"] == dict(cpu_s=2.0, busy_fraction=0.5, rss_mib_end=2.0)
    assert d["processes"]["bench"]["busy_fraction"] == pytest.approx(0.1)
    assert d["processes"]["gone"] == dict(cpu_s=None, busy_fraction=None, rss_mib_end=None)


# --- Stats deltas --------------------------------------------------------------------------------------------------

def test_engine_delta_differences_counters_keeps_gauges_and_computes_ratios():
    before = dict(coordinator=coordinator(prefix_queries=10, prefix_hits=5, prompt_tokens=1000, computed_tokens=900,
                                          tokens_generated=100, requests_finished=10, preemptions=1,
                                          rejections={"NO_CAPACITY": 2, "FRAME_LOST": 1}),
                  stages=[stage(busy_seconds=1.0, uptime_seconds=10.0, rejections={"NO_CAPACITY": 1})], errors=[])
    after = dict(coordinator=coordinator(prefix_queries=20, prefix_hits=13, prefix_hit_tokens=4000,
                                         prompt_tokens=6000, computed_tokens=2900, tokens_generated=410,
                                         requests_finished=20, preemptions=4, kv_blocks_used=30, kv_blocks_total=120,
                                         prefix_cache=True, rejections={"NO_CAPACITY": 7, "FRAME_LOST": 1}),
                 stages=[stage(busy_seconds=4.0, uptime_seconds=14.0, prefix_queries=8, prefix_hits=2, steps=50,
                               kv_blocks_used=3, kv_blocks_cached=5, kv_blocks_total=10,
                               rejections={"NO_CAPACITY": 4})], errors=[])
    d = cluster_stats.engine_delta(before, after)
    c = d["coordinator"]
    assert (c["prefix_queries"], c["prefix_hits"], c["prefix_hit_tokens"], c["preemptions"]) == (10, 8, 4000, 3)
    assert c["prefix_hit_rate"] == pytest.approx(0.8)
    assert c["computed_per_prompt_token"] == pytest.approx(2000 / 5000)
    # decode rows: 310 generated - 10 finished = 300; prefill ≈ 2000 - 300
    assert c["prefill_computed_est"] == 1700 and c["prefill_per_prompt_token_est"] == pytest.approx(1700 / 5000)
    assert c["rejections"] == {"NO_CAPACITY": 5}            # unchanged reasons drop out
    assert (c["kv_blocks_used_end"], c["kv_blocks_total_end"], c["prefix_cache_end"]) == (30, 120, True)
    assert c["kv_blocks_used_fraction_end"] == pytest.approx(0.25)
    s = d["stages"][0]
    assert s["busy_fraction"] == pytest.approx(3.0 / 4.0) and s["prefix_hit_rate"] == pytest.approx(0.25)
    assert s["rejections"] == {"NO_CAPACITY": 3} and s["steps"] == 50
    assert (s["kv_blocks_used_end"], s["kv_blocks_cached_end"], s["kv_blocks_total_end"]) == (3, 5, 10)


def test_a_served_step_is_split_into_each_stages_busy_time_and_the_rest():
    # 100 steps over 4 s: 40 ms a step; stage 0 busy 1.5 s (15 ms a step), stage 1 2.0 s (20 ms, 3 of it sampling)
    before = [stage(busy_seconds=1.0, steps=10), stage(busy_seconds=2.0, steps=10, sampling_seconds=0.5)]
    after = [stage(busy_seconds=2.5, steps=110), stage(busy_seconds=4.0, steps=110, sampling_seconds=0.8)]
    stages = [cluster_stats.stage_delta(b, a) for b, a in zip(before, after)]
    step = cluster_stats.served_step(4.0, stages)
    assert step is not None
    assert step["step_ms"] == pytest.approx(40.0) and step["busy_ms"] == pytest.approx([15.0, 20.0])
    assert step["sampling_ms"] == pytest.approx(3.0) and step["rest_ms"] == pytest.approx(5.0)
    assert cluster_stats.served_step_text(step) == \
        "40.0 ms a step: stage 0 15.0 + stage 1 20.0 (sampling 3.0) + 5.0 outside the stages"
    # two micro-batches in flight: the stages overlap, so the rest reads negative rather than being hidden
    assert cluster_stats.served_step(2.0, stages)["rest_ms"] == pytest.approx(-15.0)
    # a stage not read, or one that ran no step: no split at all
    assert cluster_stats.served_step(4.0, [stages[0], None]) is None
    assert cluster_stats.served_step(4.0, [stages[0], cluster_stats.stage_delta(stage(), stage())]) is None
    assert cluster_stats.served_step(4.0, []) is None and cluster_stats.served_step_text(None) == "–"


def test_fields_reading_zero_give_unknown_ratios_not_zero():
    zero = dict(coordinator=coordinator(), stages=[stage()], errors=[])
    d = cluster_stats.engine_delta(zero, zero)
    c = d["coordinator"]
    assert c["prefix_hit_rate"] is c["computed_per_prompt_token"] is c["prefill_per_prompt_token_est"] is None
    assert d["stages"][0]["busy_fraction"] is None and c["kv_blocks_used_fraction_end"] is None


def test_a_side_not_read_stays_none_and_errors_are_kept():
    before = dict(coordinator=None, stages=[None, stage()], errors=["coordinator x: UNAVAILABLE"])
    after = dict(coordinator=coordinator(), stages=[stage(), stage()], errors=[])
    d = cluster_stats.engine_delta(before, after)
    assert d["coordinator"] is None and d["stages"][0] is None and d["stages"][1] is not None
    assert d["errors"] == ["coordinator x: UNAVAILABLE"]


def test_read_engine_records_an_unreachable_service_instead_of_raising():
    port = __import__("tether.cli.cluster", fromlist=["free_port"]).free_port()
    out = cluster_stats.read_engine(f"127.0.0.1:{port}", [f"127.0.0.1:{port}"], timeout=0.5)
    assert out["coordinator"] is None and out["stages"] == [None] and len(out["errors"]) == 2


# --- with and without the cache ------------------------------------------------------------------------------------

def level(label: str, ttft_ms: list[float], hit_rate: float) -> dict:
    recs = [RequestRecord(BenchRequest(i, "multiturn", "p", 4), label, ttft=t / 1000, e2e=t / 1000 + 0.2,
                          token_ids=[1, 2, 3]) for i, t in enumerate(ttft_ms)]
    c = cluster_stats.coordinator_delta(coordinator(), coordinator(prefix_queries=10, prefix_hits=round(10 * hit_rate),
                                                            prompt_tokens=100, computed_tokens=40))
    return dict(label=label, summary=stats.level_summary(recs, 1.0, None),
                engine=dict(coordinator=c, stages=[], errors=[]))


def test_compare_pairs_levels_by_order_and_divides_with_by_without():
    levels = [level("concurrency 8, prefix cache off", [100, 200, 300], 0.0),
              level("concurrency 8, prefix cache on", [20, 40, 60], 0.9)]
    cmp = cluster_stats.compare_prefix_cache(levels)
    (row,) = cmp["rows"]
    assert row["level"] == "concurrency 8"
    assert (row["ttft_p50_ms_off"], row["ttft_p50_ms_on"]) == (200.0, 40.0)
    assert row["ttft_p50_ratio"] == pytest.approx(0.2)
    assert row["hit_rate_on"] == pytest.approx(0.9) and row["hit_rate_off"] == 0.0
    assert cmp["ttft_ratio_target"] == 0.3
    md = "\n".join(report._compare_md(cmp))
    assert "**0.20**" in md and "≤ 0.3" in md


# --- flags ---------------------------------------------------------------------------------------------------------

def test_spawned_cluster_flags():
    args = build_parser().parse_args(["--spawn", "--stage-kv-tokens", "4096"])
    assert cluster_extra(args, prefix_cache=True) == {"stage": ["--kv-capacity", "4096"]}
    assert cluster_extra(args, prefix_cache=False) == {"stage": ["--kv-capacity", "4096"],
                                                       "coordinator": ["--no-prefix-cache"]}
    assert cluster_extra(build_parser().parse_args([]), prefix_cache=True) == {}
    q8 = build_parser().parse_args(["--spawn", "--stage-kv-tokens", "4096", "--linear-inputs", "q8"])
    assert cluster_extra(q8, prefix_cache=True) == {"stage": ["--kv-capacity", "4096", "--linear-inputs", "q8"]}


@pytest.mark.parametrize("argv, message", [
    (["--no-prefix-cache"], "needs --spawn"),
    (["--compare-prefix-cache"], "needs --spawn"),
    (["--stage-kv-tokens", "100"], "needs --spawn"),
    (["--spawn", "--compare-prefix-cache", "--no-prefix-cache"], "drop --no-prefix-cache"),
    (["--spawn", "--compare-prefix-cache", "--chaos"], "run them separately"),
])
def test_engine_flags_that_cannot_work_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        check_engine_args(build_parser().parse_args(argv))


def test_engine_flags_that_work_pass():
    for argv in (["--spawn", "--compare-prefix-cache"], ["--spawn", "--no-prefix-cache", "--stage-kv-tokens", "9"],
                 ["--coordinator", "127.0.0.1:1", "--stage-addresses", "127.0.0.1:2", "--pids", "stage0=1"], []):
        check_engine_args(build_parser().parse_args(argv))


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]     # a stand-in tokenizer: one token per character


def test_offered_context_against_the_stage_pool():
    args = build_parser().parse_args(["--spawn", "--workload", "synthetic", "--input-len", "300", "--output-len",
                                      "100", "--range-ratio", "0", "--concurrency", "10", "--stage-kv-tokens", "2000"])
    w = Workload(args.workload, chars, __import__("tether.loadtest.workloads", fromlist=["x"]).SyntheticSpec(300, 100, 0))
    ctx = offered_context(args, w)
    assert ctx["mean_context_tokens"] == 400 and ctx["offered_tokens"] == 4000
    assert ctx["offered_per_pool"] == pytest.approx(2.0)


# --- shared-doc ----------------------------------------------------------------------------------------------------

def test_shared_doc_is_one_passage_asked_different_questions_deterministically():
    w = Workload(parse_mix("shared-doc"), chars, shared_doc=SharedDocSpec(tokens=1500, output_tokens=16))
    a = w.take(30, 1)
    assert a == w.take(30, 1) and a != w.take(30, 2)
    doc = w.shared_passage()
    assert all(r.prompt.startswith(doc) and r.workload == "shared-doc" and r.max_tokens == 16 for r in a)
    assert 1000 <= len(chars(a[0].prompt)) <= 1500
    assert len({r.prompt.rpartition("Question: ")[2] for r in a}) > 5
    assert all(r.prompt.rpartition("Question: ")[2] in SHARED_DOC_QUESTIONS for r in a)
    # the passage does not depend on the stream's seed, or on another instance: levels and clusters share it
    assert Workload(parse_mix("shared-doc"), chars).shared_passage() == doc


def test_shared_doc_in_a_mix():
    w = Workload(parse_mix("single:1,shared-doc:1"), chars)
    assert {r.workload for r in w.take(40, 0)} == {"single", "shared-doc"}


# --- the report ----------------------------------------------------------------------------------------------------

def test_report_shows_engine_and_cpu_figures():
    lv = level("concurrency 4", [100, 200], 0.5)
    lv["engine"]["coordinator"]["rejections"] = {"NO_CAPACITY": 3}
    lv["engine"]["stages"] = [cluster_stats.stage_delta(stage(), stage(busy_seconds=2.0, uptime_seconds=4.0,
                                                                 rejections={"NO_CAPACITY": 1}))]
    lv["engine"]["client_prompt_tokens"] = 100
    lv["cpu"] = cluster_stats.cpu_delta(dict(wall=0.0, cpu={"stage0": 0.0, "bench": 0.0}),
                                 dict(wall=2.0, cpu={"stage0": 1.5, "bench": 0.2}, rss_kib={"stage0": 1024}))
    lv.update(mode="closed", rate=0.0, concurrency=4, load_average=[0.1, 0.2], by_workload={}, by_tag={}, audit=None)
    (row,) = report.engine_rows([lv])
    assert row["prefix hit rate"] == "0.50" and row["NO_CAPACITY coordinator / stages"] == "3 / 1"
    assert row["rejections (coordinator)"] == "NO_CAPACITY 3" and row["stage busy"] == "0.50"
    assert row["CPU busy: bench"] == "0.10" and row["CPU busy: services"] == "stage0 0.75"
    md = "\n".join(report._engine_level_md(lv))
    assert "5 hits of 10 queries" in md and "| stage0 | 1.50 | 0.75 | 1.0 |" in md
    meta = dict(date="d", command="c", target="t", spawned=True, model="tiny", model_fingerprint="f", stages=1,
                stage_threads=1, machine=dict(cores=2, torch="x", python="3", platform="p"), load_average_start=0.1,
                workload=dict(mix="multiturn:1", seed=0), budget="2 requests", warmup=1, timeout_s=1.0, slo=None)
    rep = dict(meta=meta, chaos=not_requested(), levels=[lv], plots=[], plots_note="no plots")
    assert "## Engine" in report.markdown(rep)
    lines: list[str] = []
    print_summary(rep, [], lines.append)
    assert any("stage busy" in line for line in lines)


def test_levels_without_engine_figures_add_nothing():
    lv = level("rate 1/s", [100], 0.0)
    lv["engine"] = lv["cpu"] = None
    assert report.engine_rows([lv]) == [] and report._engine_level_md(lv) == []


def test_compare_with_repeats_pairs_each_repeat_and_takes_medians():
    levels = []
    for r, (off, on) in enumerate(((100, 30), (200, 40), (100, 90))):
        levels += [level(f"rate 1/s, prefix cache off #{r + 1}", [off], 0.0),
                   level(f"rate 1/s, prefix cache on #{r + 1}", [on], 0.8)]
    levels.insert(1, level("rate 2/s, prefix cache off #1", [50], 0.0))     # unpaired: left out
    cmp = cluster_stats.compare_prefix_cache(levels)
    assert [r["level"] for r in cmp["rows"]] == ["rate 1/s #1", "rate 1/s #2", "rate 1/s #3"]
    (summary,) = cmp["levels"]
    assert summary["level"] == "rate 1/s" and summary["repeats"] == 3
    assert summary["ttft_p50_ratio"] == pytest.approx(0.3)     # median of 0.3, 0.2, 0.9
    assert "Medians over the repeats" in "\n".join(report._compare_md(cmp))


def test_compare_repeats_need_the_comparison():
    with pytest.raises(SystemExit, match="--compare-repeats is for"):
        check_engine_args(build_parser().parse_args(["--spawn", "--compare-repeats", "3"]))


def test_worker_processes_fold_into_their_service():
    procs = {"admission": dict(busy_fraction=0.2), "admission/child-7": dict(busy_fraction=0.3),
             "stage0": dict(busy_fraction=0.5), "stage0/child-9": dict(busy_fraction=None)}
    assert report.fold_children(procs) == {"admission": pytest.approx(0.5), "stage0": None}
