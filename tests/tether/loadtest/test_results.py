"""The bench's typed records become report.json's dicts with the keys, order and values the report promises;
the chaos supervisor's reseeded argv is a new list."""

from __future__ import annotations

import json

from tether.loadtest import chaos
from tether.loadtest.results import BaselinesResult, ChaosCell, LevelResult, Side, SpawnedRun, StageExit

LEVEL_KEYS = ["label", "mode", "rate", "concurrency", "load_average", "summary", "by_workload", "by_tag", "audit",
              "engine", "cpu"]
CELL_KEYS = ["stamp_checks", "requests", "completed", "injected", "injected_by_kind", "detected",
             "detected_at_stages", "detected_at_coordinator", "recovered", "rebuilds", "resumes",
             "pipeline_reconnects", "stage_crashes", "failed", "failed_by_status", "wrong_answers", "exact",
             "within_margin", "not_audited"]


def level(**kw) -> LevelResult:
    return LevelResult("rate 1/s", "open", 1.0, 0, (0.1, 0.2), {}, {}, {}, None, None, None, **kw)


def test_a_level_is_the_report_dict_with_capacity_only_when_searched():
    out = level().to_json()
    assert list(out) == LEVEL_KEYS and out["load_average"] == [0.1, 0.2]
    out = level(capacity=dict(meets=True, why="ok")).to_json()
    assert list(out) == [*LEVEL_KEYS, "capacity"] and out["capacity"] == {"meets": True, "why": "ok"}
    json.dumps(out)


def test_baselines_give_medians_ratios_and_errors_only_where_a_side_failed():
    b = BaselinesResult(4, 4, 4, 1, 1, 2, 2, served=Side([40.0, 60.0]), engine=Side([100.0, 100.0]),
                        hf=Side([20.0, 30.0]), hf_cb=Side(error="generate_batch failed: x"),
                        llama_cpp=Side([80.0, 120.0], ttft_p50_ms=[10.0, 30.0], tpot_p50_ms=[5.0, 7.0]),
                        llama_cpp_threads=2, llama_cpp_command="python -m llama_cpp.server")
    out = b.to_json()
    assert list(out) == ["requests", "completed", "batch_size", "threads", "stage_threads", "stages", "repeats",
                         "served", "engine", "hf", "hf_cb", "llama_cpp", "llama_cpp_threads", "llama_cpp_command",
                         "ratios"]
    assert out["served"] == {"output_token_throughput": 50.0, "runs": [40.0, 60.0]}
    assert out["hf_cb"] == {"output_token_throughput": None, "runs": [], "error": "generate_batch failed: x"}
    assert out["llama_cpp"] == {"output_token_throughput": 100.0, "runs": [80.0, 120.0], "ttft_p50_ms": 20.0,
                                "tpot_p50_ms": 6.0, "ttft_p50_ms_runs": [10.0, 30.0], "tpot_p50_ms_runs": [5.0, 7.0]}
    assert out["ratios"] == {"vs_engine": 0.5, "vs_hf": 2.0, "vs_hf_cb": None, "vs_llama_cpp": 0.5}
    skipped = BaselinesResult(4, 4, 4, 1, 1, 2, 1, Side([1.0]), Side([1.0]), Side([1.0]), Side([1.0]),
                              llama_cpp=Side(error="model tiny has no GGUF file")).to_json()
    assert skipped["llama_cpp"]["error"] == "model tiny has no GGUF file" and skipped["ratios"]["vs_llama_cpp"] is None


def test_a_chaos_cell_sums_its_counts_and_adds_what_a_spawned_run_knows():
    cell = ChaosCell(True, 3, 2, {"drop": 2}, {"BAD_SEQUENCE": 1}, {"FRAME_LOST": 2}, 1, 2, 0, 0, 0,
                     {"ABORTED": 1}, 0, 2, 0, 0)
    out = cell.to_json()
    assert list(out) == CELL_KEYS
    assert (out["injected"], out["detected"], out["failed"]) == (2, 3, 1)
    cell.faults_by_kind = {"drop": dict(logged=2)}
    cell.spawned = SpawnedRun(1.5, "drop=0.1,seed=11", [StageExit("stage0", 137, 2.0)], 0, [], [])
    cell.stats = {"coordinator": {}}
    out = cell.to_json()
    assert list(out) == [*CELL_KEYS, "faults_by_kind", "wall_s", "spec", "stage_exits", "failed_restarts",
                         "restart_errors", "mismatches", "stats"]
    assert out["stage_exits"] == [{"stage": "stage0", "status": 137, "uptime_s": 2.0}]


def test_a_restarted_stage_gets_a_new_argv_with_the_next_seed():
    argv = ["python", "-m", "services.stage_worker", "--faults", "crash=0.1,seed=11", "--port", "1"]
    new = chaos.with_faults(argv, "crash=0.1,seed=12")
    assert new == ["python", "-m", "services.stage_worker", "--faults", "crash=0.1,seed=12", "--port", "1"]
    assert argv[4] == "crash=0.1,seed=11"            # the old one is left as it was
    plain = ["python", "-m", "services.stage_worker"]
    assert chaos.with_faults(plain, "x") == plain and chaos.with_faults(plain, "x") is not plain
