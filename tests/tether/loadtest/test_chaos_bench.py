"""`tether bench --chaos`: the plan, the per-kind cells and table from Stats (pure), the report, and one real run
showing the 答非所问 failure with the stamp checks off and none with them on."""

from __future__ import annotations

import json

import pytest

from tether import reference
from tether.loadtest import chaos, report, stats
from tether.loadtest.cli import build_parser, check_target_args, print_summary
from tether.loadtest.cli import main as bench_main
from tether.loadtest.records import RequestRecord
from tether.loadtest.workloads import BenchRequest
from tether.faults import KINDS, FaultConfig


def rec(i: int, verdict: str = reference.EXACT, error: str = "") -> RequestRecord:
    r = RequestRecord(BenchRequest(i, "single", f"prompt {i}", 8), "chaos", token_ids=[] if error else [1, 2, 3])
    r.error_code, r.verdict = error, "" if error else verdict
    return r


def stage(faults=None, rejections=None, checks=True, address="s") -> dict:
    return dict(address=address, faults_injected=faults or {}, rejections=rejections or {}, stamp_checks=checks)


def coordinator(faults=None, rejections=None, checks=True, recovered=0, rebuilds=0, resumes=0) -> dict:
    return dict(address="c", faults_injected=faults or {}, rejections=rejections or {}, recovered=recovered,
                rebuilds=rebuilds, resumes=resumes, requests_failed=0, pipeline_reconnects=0, stamp_checks=checks)


# --- the plan --------------------------------------------------------------------------------------------------

def test_plan_all_kinds_and_specs():
    assert list(chaos.parse_plan("all").rates) == list(KINDS)
    assert chaos.parse_plan("all").rates == chaos.DEFAULT_RATES
    p = chaos.parse_plan("corrupt=0.2,forget_kv,drop=0.05,seed=7,delay_ms=20")
    assert p.rates == {"drop": 0.05, "corrupt": 0.2, "forget_kv": chaos.DEFAULT_RATES["forget_kv"]}   # KINDS order
    assert p.seed == 7 and p.delay_ms == 20
    assert chaos.parse_plan("all,drop=0.3").rates["drop"] == 0.3                # an explicit rate wins
    # each run enables exactly one kind, parseable by the services' own --faults parser
    assert FaultConfig.parse(p.spec("drop")) == FaultConfig(rates={"drop": 0.05}, seed=7, delay_ms=20)
    assert FaultConfig.parse(chaos.parse_plan("forget_kv").spec("forget_kv")).seed == chaos.DEFAULT_SEED


def test_a_kind_without_a_default_rate_runs_at_the_fallback(monkeypatch):
    monkeypatch.delitem(chaos.DEFAULT_RATES, "crash")   # as a new kind would be before it gets a default
    assert chaos.parse_plan("crash").rates == {"crash": chaos.FALLBACK_RATE}
    assert chaos.parse_plan("all").rates["crash"] == chaos.FALLBACK_RATE
    assert chaos.parse_plan("crash").spec("crash", seed_offset=2).endswith(",delay_ms=50") and \
        f"seed={chaos.DEFAULT_SEED + 2}" in chaos.parse_plan("crash").spec("crash", seed_offset=2)


@pytest.mark.parametrize("text,msg", [("bogus", "unknown fault kind 'bogus'"), ("drop=2", "must be in \\[0, 1\\]"),
                                      ("seed=3", "no fault kind"), ("", "no fault kind"),
                                      ("drop=0.1,drop=0.2", "twice")])
def test_plan_refuses_bad_text(text, msg):
    with pytest.raises(ValueError, match=msg):
        chaos.parse_plan(text)


def test_chaos_option_bare_means_all_and_is_off_by_default():
    parse = build_parser().parse_args
    assert parse([]).chaos is None
    assert parse(["--spawn", "--chaos"]).chaos.rates == chaos.DEFAULT_RATES
    assert parse(["--spawn", "--chaos", "drop=0.05,corrupt=0.1"]).chaos.rates == {"drop": 0.05, "corrupt": 0.1}
    with pytest.raises(SystemExit):
        parse(["--chaos", "nonsense"])


def test_unsafe_switch_only_on_the_checks_off_run():
    plan = chaos.parse_plan("forget_kv=0.1")
    on, off = chaos.cluster_flags(plan, "forget_kv", "on"), chaos.cluster_flags(plan, "forget_kv", "off")
    assert on == {"stage": ["--faults", "forget_kv=0.1,seed=11,delay_ms=50"], "coordinator": ["--frame-timeout", "3"]}
    assert off["stage"] == on["stage"] + [chaos.UNSAFE_FLAG]
    assert off["coordinator"] == on["coordinator"] + [chaos.UNSAFE_FLAG]


def test_chaos_clusters_start_with_the_bench_clusters_flags():
    """`tether bench --spawn --linear-inputs q8 --chaos`: every chaos cluster's stages compute in q8 too (the audit's
    reference does; before, they served float32 and the audit counted their answers wrong), after the bench's own
    flags the faults; the base is not modified."""
    from tether.loadtest.cli import cluster_extra
    args = build_parser().parse_args(["--spawn", "--chaos", "--linear-inputs", "q8", "--route-policy", "least-loaded"])
    base = cluster_extra(args, prefix_cache=False)
    before = {k: list(v) for k, v in base.items()}
    plan = chaos.parse_plan("drop=0.1")
    got = chaos.cluster_flags(plan, "drop", "off", base)
    assert got["stage"][:2] == ["--linear-inputs", "q8"] and got["stage"][2:] == [
        *chaos.cluster_flags(plan, "drop", "off")["stage"]]
    assert got["coordinator"][0] == "--no-prefix-cache" and got["admission"] == ["--route-policy", "least-loaded"]
    assert base == before


def test_against_a_running_cluster_chaos_needs_the_coordinator():
    args = build_parser().parse_args(["--chaos"])
    with pytest.raises(SystemExit, match="needs --coordinator"):
        check_target_args(args)
    check_target_args(build_parser().parse_args(["--chaos", "--coordinator", "127.0.0.1:1"]))
    check_target_args(build_parser().parse_args(["--chaos", "--spawn"]))


# --- cells and the table from fake Stats ---------------------------------------------------------------------

def test_cell_adds_stages_and_coordinator():
    stats = dict(coordinator=coordinator(rejections={"UNKNOWN_REQUEST": 4, "FRAME_LOST": 1}, recovered=3,
                                         rebuilds=5, resumes=1),
                 stages=[stage({"forget_kv": 3}, {"UNKNOWN_REQUEST": 2}),
                         stage({"forget_kv": 2}, {"UNKNOWN_REQUEST": 2})])
    records = [rec(0), rec(1, reference.WITHIN_MARGIN), rec(2, error="ABORTED"), rec(3, error="ABORTED"),
               rec(4, error="UNAVAILABLE")]
    c = chaos.chaos_cell(stats, records).to_json()
    assert c["injected"] == 5 and c["injected_by_kind"] == {"forget_kv": 5}
    assert c["detected"] == 9
    assert c["detected_at_stages"] == {"UNKNOWN_REQUEST": 4}
    assert c["detected_at_coordinator"] == {"FRAME_LOST": 1, "UNKNOWN_REQUEST": 4}
    assert (c["recovered"], c["rebuilds"], c["resumes"]) == (3, 5, 1)
    assert c["failed"] == 3 and c["failed_by_status"] == {"ABORTED": 2, "UNAVAILABLE": 1}
    assert (c["requests"], c["completed"], c["exact"], c["within_margin"], c["wrong_answers"]) == (5, 2, 1, 1, 0)
    assert c["stamp_checks"] is True


def test_cell_with_checks_off_counts_wrong_answers_and_crashes():
    stats = dict(coordinator=coordinator(checks=False),
                 stages=[stage({"crash": 0}, checks=False), stage({}, checks=False)])
    records = [rec(0, reference.MISMATCH), rec(1, reference.MISMATCH), rec(2), rec(3, verdict="")]
    c = chaos.chaos_cell(stats, records, crashes=2).to_json()
    assert c["stamp_checks"] is False
    assert c["injected"] == 2 and c["injected_by_kind"] == {"crash": 2} and c["stage_crashes"] == 2
    assert c["detected"] == 0 and c["failed"] == 0
    assert c["wrong_answers"] == 2 and c["exact"] == 1 and c["not_audited"] == 1
    # one stage with its checks off is enough to call the run unchecked
    mixed = dict(coordinator=coordinator(), stages=[stage(), stage(checks=False)])
    assert chaos.chaos_cell(mixed, []).stamp_checks is False


def test_the_ledger_counts_distinct_faults_by_fate(tmp_path):
    (tmp_path / "stage0.log").write_text(
        "x stage INFO fault 1 corrupt at outbound: a@1:5 b@2:0\n"
        "x stage INFO fault 1 corrupt: a@1:5 caught (next seen a@2:0)\n"
        "x stage INFO fault 2 reorder at outbound: c@1:3\n"
        "x stage INFO fault 2 reorder: harmless (went out in order after all)\n"
        "x stage INFO fault 3 duplicate at outbound: a@2:0\n"
        "x stage CRITICAL fault injection: crashing now (exit 137)\n"
        "x stage INFO fault 1 forget_kv at arrival: d@1:9\n"             # a restarted stage counts from 1
        "x stage ERROR fault 1 forget_kv: d@1:9 SLIPPED THROUGH (next seen d@1:10)\n")
    (tmp_path / "stage1.log").write_text("x stage INFO fault 1 cross_ids at reply: \n")   # only rejections hit
    faults = chaos.read_ledger(tmp_path)
    assert faults[("stage0", 0, 1)]["slots"] == {("a", 1, 5): "caught", ("b", 2, 0): "open"}
    assert faults[("stage0", 1, 1)]["slots"] == {("d", 1, 9): "slipped"}
    assert chaos.ledger_counts(faults) == {
        "corrupt": dict(logged=1, followed=1, caught=0, slipped=0, open=1),
        "cross_ids": dict(logged=1, followed=1, caught=1, slipped=0, open=0),
        "duplicate": dict(logged=1, followed=0, caught=0, slipped=0, open=0),
        "forget_kv": dict(logged=1, followed=1, caught=0, slipped=1, open=0),
        "reorder": dict(logged=1, followed=0, caught=0, slipped=0, open=0)}


def test_table_puts_checks_on_and_off_side_by_side():
    on = chaos.chaos_cell(dict(coordinator=coordinator(), stages=[stage({"drop": 2}, {"BAD_SEQUENCE": 3})]), [rec(0)])
    off = chaos.chaos_cell(dict(coordinator=coordinator(checks=False), stages=[stage({"drop": 2}, checks=False)]),
                           [rec(0, reference.MISMATCH)])
    only_on = chaos.chaos_cell(dict(coordinator=coordinator(), stages=[]), [])
    rows = chaos.chaos_table([("drop", "on", on), ("corrupt", "on", only_on), ("drop", "off", off)])
    assert [r["kind"] for r in rows] == ["drop", "corrupt"]
    assert rows[0]["on"] == on.to_json() and rows[0]["off"] == off.to_json() and rows[1]["off"] is None
    assert chaos.totals(rows) == {"wrong_answers_checks_on": 0, "wrong_answers_checks_off": 1}
    text = report.chaos_rows(rows)
    assert text[0] == ["drop", "2", "3", "0", "0", "0 of 1", "2", "0", "0", "0", "**1 of 1**"]
    assert text[1][0] == "corrupt" and text[1][6] == "not run"
    with pytest.raises(ValueError):
        chaos.chaos_table([("drop", "maybe", on)])


def test_stats_delta_and_the_target_report():
    before = dict(coordinator=coordinator({"drop": 1}, {"FRAME_LOST": 2}, recovered=1, rebuilds=2),
                  stages=[stage({"corrupt": 4}, {"DIGEST_MISMATCH": 4})])
    after = dict(coordinator=coordinator({"drop": 3}, {"FRAME_LOST": 2, "DIGEST_MISMATCH": 5}, recovered=4,
                                         rebuilds=9),
                 stages=[stage({"corrupt": 9}, {"DIGEST_MISMATCH": 9})])
    d = chaos.stats_delta(before, after)
    assert d["coordinator"]["faults_injected"] == {"drop": 2}
    assert d["coordinator"]["rejections"] == {"DIGEST_MISMATCH": 5}          # FRAME_LOST did not move
    assert d["coordinator"]["recovered"] == 3 and d["coordinator"]["stamp_checks"] is True
    assert d["stages"][0]["faults_injected"] == {"corrupt": 5}
    rep = chaos.target_report(before, after, [rec(0), rec(1, error="ABORTED")])
    assert rep["mode"] == "target" and rep["stages"] == ["s"]
    (row,) = rep["rows"]
    assert row["kind"] == "corrupt+drop" and row["off"] is None
    assert (row["on"]["injected"], row["on"]["detected"], row["on"]["recovered"], row["on"]["failed"]) == (7, 10, 3, 1)
    md = "\n".join(report._chaos_md(rep))
    assert "Against the running cluster (coordinator c)" in md
    assert "| corrupt+drop | 7 | 10 (5+5) | 3 | 1 | 0 of 1 |" in md


def test_markdown_of_a_spawned_chaos_run():
    plan = chaos.parse_plan("forget_kv=0.1")
    on = chaos.chaos_cell(dict(coordinator=coordinator(rejections={"UNKNOWN_REQUEST": 3}, recovered=2),
                               stages=[stage({"forget_kv": 3}, {"UNKNOWN_REQUEST": 3})]), [rec(0), rec(1)])
    off = chaos.chaos_cell(dict(coordinator=coordinator(checks=False), stages=[stage({"forget_kv": 4}, checks=False)]),
                           [rec(0, reference.MISMATCH), rec(1)])
    rows = chaos.chaos_table([("forget_kv", "on", on), ("forget_kv", "off", off)])
    rep = dict(requested=True, available=True, mode="spawn", plan=plan.to_json(),
               coordinator_flags=chaos.COORDINATOR_FLAGS, unsafe_flag=chaos.UNSAFE_FLAG,
               load=dict(level="concurrency 4", budget="2 requests"), rows=rows, totals=chaos.totals(rows))
    md = "\n".join(report._chaos_md(rep))
    assert "| fault kind | ON: injected | ON: detected | ON: recovered | ON: failed explicitly | ON: wrong answers " \
           "| OFF: injected |" in md
    assert "| forget_kv | 3 | 6 (3+3) | 2 | 0 | 0 of 2 | 4 | 0 | 0 | 0 | **1 of 2** |" in md
    assert "Wrong answers: **0** with stamp checks on, **1** with them off." in md
    assert "`--unsafe-disable-stamp-checks` (experiment only)" in md and "`--frame-timeout 3`" in md
    assert "`forget_kv` (rate 0.1): checks on: 2/2 done" in md
    json.dumps(rep)
    # the one-screen summary at the end of a run
    done = [rec(0), rec(1)]
    for r in done:
        r.ttft, r.e2e = 0.1, 0.5
    level = dict(label="concurrency 4", summary=stats.level_summary(done, 1.0, None), audit=None)
    rows.append(dict(kind="corrupt", on=on.to_json(), off=None))
    lines: list[str] = []
    print_summary(dict(meta=dict(model="tiny", target="t"), levels=[level], chaos=dict(rep, rows=rows)), [],
                  lines.append)
    assert any(line.split() == ["forget_kv", "3", "/", "6", "(3+3)", "/", "2", "/", "0", "/", "0", "of", "2",
                                "4", "/", "0", "/", "0", "/", "0", "/", "1", "of", "2"] for line in lines), lines
    assert any(line.split()[:1] == ["corrupt"] and line.rstrip().endswith("not run") for line in lines), lines
    assert any("wrong answers: 0 with stamp checks on, 1 with them off" in line for line in lines)


# --- one real run ----------------------------------------------------------------------------------------------

def test_forget_kv_gives_wrong_answers_only_with_the_checks_off(tmp_path):
    """The 答非所问 failure reproduced: a stage forgetting request state under load. With the stamp checks every
    lost state is caught (UNKNOWN_REQUEST) and the request replayed or failed explicitly; with the unsafe switch
    the stage runs the next token on empty state and the answer silently changes."""
    bench_main(["--spawn", "--model", "tiny", "--chaos", "forget_kv=0.1", "--concurrency", "4", "--num-requests", "6", "--warmup", "1",
                "--workload", "single", "--quiet", "--out", str(tmp_path)])
    rep = json.loads((tmp_path / "report.json").read_text())
    c = rep["chaos"]
    assert c["requested"] and c["available"] and c["mode"] == "spawn" and c["plan"]["rates"] == {"forget_kv": 0.1}
    (row,) = c["rows"]
    on, off = row["on"], row["off"]
    assert on["stamp_checks"] and not off["stamp_checks"]
    assert on["injected_by_kind"].get("forget_kv", 0) > 0 and off["injected_by_kind"].get("forget_kv", 0) > 0
    assert on["wrong_answers"] == 0, on["mismatches"]
    # distinct faults, not rejections summed over checkpoints: each forgotten state was acted on by the
    # coordinator (rebuilt or resent) before it appended a token; one left open belongs to a request that failed
    fk = on["faults_by_kind"]["forget_kv"]
    assert fk["logged"] == fk["followed"] == on["injected_by_kind"]["forget_kv"], on["faults_by_kind"]
    assert fk["slipped"] == 0 and fk["caught"] > 0 and fk["caught"] + fk["open"] == fk["followed"], fk
    assert fk["open"] <= on["failed"], (fk, on["failed_by_status"])
    assert on["completed"] + on["failed"] == 6 and set(on["failed_by_status"]) <= {"ABORTED"}
    assert on["completed"] == on["exact"] and on["within_margin"] == 0   # a replay gives the very same tokens
    assert off["wrong_answers"] > 0 and off["detected"] == 0
    assert off["faults_by_kind"]["forget_kv"]["slipped"] > 0      # the ledger sees the coordinator carry on
    assert c["totals"] == {"wrong_answers_checks_on": 0, "wrong_answers_checks_off": off["wrong_answers"]}
    md = (tmp_path / "report.md").read_text()
    assert "| forget_kv |" in md and "Unavailable" not in md
    lines = (tmp_path / "requests.jsonl").read_text().splitlines()
    chaos_lines = [json.loads(x) for x in lines if json.loads(x)["level"].startswith("chaos forget_kv")]
    assert len(chaos_lines) == 12 and all(x["verdict"] or x["error_code"] for x in chaos_lines)

