"""Report writers: JSON, requests.jsonl, Markdown and plots, with and without matplotlib; the progress line."""

from __future__ import annotations

import io
import json
import sys

import pytest

from tether.loadtest import report, stats
from tether.loadtest.audit import AuditSummary
from tether.loadtest.cli import print_summary
from tether.loadtest.progress import Progress
from tether.loadtest.records import BREAKDOWN_TAGS, RequestRecord
from tether.loadtest.chaos import not_requested
from tether.loadtest.workloads import BenchRequest


def records(level: str, n: int = 6) -> list[RequestRecord]:
    out = []
    for i in range(n):
        r = RequestRecord(BenchRequest(i, "single" if i % 2 else "long", f"prompt {i}", 8), level, start=0.1 * i,
                          ttft=0.05 * (i + 1), e2e=0.5 + 0.1 * i, token_ids=[1, 2, 3, 4], itl=[0.1, 0.1, 0.1],
                          tags={"language": "en", "task": "qa", "size_class": "short", "length_limit": 0,
                                "output_budget": 8}, prompt_tokens=10)
        if i == n - 1:
            r.error_code, r.token_ids, r.ttft, r.e2e, r.itl = "UNAVAILABLE", [], None, None, []
        out.append(r)
    return out


def build(levels: list[tuple[float, list[RequestRecord], AuditSummary | None]], baselines: dict | None = None) -> dict:
    slo = {"ttft": 200.0, "tpot": 150.0}
    lv = []
    for rate, recs, audit in levels:
        lv.append(dict(label=f"rate {rate:g}/s", mode="open", rate=rate, concurrency=0, load_average=[0.1, 0.2],
                       summary=stats.level_summary(recs, 2.0, slo),
                       by_workload=stats.breakdown(recs, lambda r: r.request.workload, 2.0, slo),
                       by_tag={t: stats.breakdown(recs, lambda r, t=t: r.tag(t), 2.0, slo) for t in BREAKDOWN_TAGS},
                       audit=audit.to_json() if audit else None))
    meta = dict(date="2026-11-29T12:00:00+00:00", command="tether bench --sweep 1,2", target="127.0.0.1:1",
                spawned=True, model="tiny", model_fingerprint="abc", stages=2, stage_threads=1,
                machine=dict(cores=2, torch="2.13.0", python="3.11", platform="linux"), load_average_start=0.1,
                workload=dict(mix="single:1", seed=0), budget="6 requests", warmup=1, timeout_s=10.0, slo=slo)
    rep = dict(meta=meta, chaos=not_requested(), levels=lv)
    if baselines:
        rep["baselines"] = baselines
    return rep


BASELINES = dict(requests=4, completed=4, batch_size=4, threads=1, stage_threads=1, stages=2, repeats=2,
                 served=dict(output_token_throughput=50.0, runs=[40.0, 60.0]),
                 engine=dict(output_token_throughput=100.0, runs=[100.0, 100.0]),
                 hf=dict(output_token_throughput=25.0, runs=[25.0, 25.0]),
                 llama_cpp=dict(output_token_throughput=None, runs=[],
                                error="model tiny has no GGUF file (only the default model, smollm2, is served "
                                      "from one)"),
                 ratios=dict(vs_engine=0.5, vs_hf=2.0))


def test_every_report_file_is_written(tmp_path):
    r1, r2 = records("rate 1/s"), records("rate 2/s")
    rep = build([(1, r1, AuditSummary(exact=4, within_margin=1)), (2, r2, AuditSummary(exact=5))], BASELINES)
    files = report.write_all(rep, r1 + r2, tmp_path / "out")
    names = {f.name for f in files}
    assert {"report.json", "report.md", "requests.jsonl"} <= names
    assert all(f.is_file() and f.stat().st_size > 0 for f in files)
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["levels"][0]["summary"]["errors_by_status"] == {"UNAVAILABLE": 1}
    assert data["levels"][1]["audit"]["exact"] == 5
    assert data["baselines"]["ratios"]["vs_engine"] == 0.5
    assert data["chaos"] == {"requested": False, "available": False, "reason": data["chaos"]["reason"]}
    lines = (tmp_path / "out" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 12 and json.loads(lines[0])["prompt"] == "prompt 0"
    md = (tmp_path / "out" / "report.md").read_text()
    for text in ("## Summary", "| rate 1/s | 5/6 |", "TTFT ≤ 200 ms", "By intent tag `language`", "By workload",
                 "tether / engine = **0.50×**", "tether / transformers = **2.00×**", "## Chaos\n\nNot requested",
                 "| llama_cpp | llama.cpp (", "| model tiny has no GGUF file", "tether / llama.cpp = **–**"):
        assert text in md, text
    assert "MISMATCH(ES) FOUND" not in md
    if _has_matplotlib():
        assert {"sweep.png", "throughput.png", "latency_cdf.png"} <= names
        assert (tmp_path / "out" / "sweep.png").read_bytes()[:4] == b"\x89PNG"
        assert "![sweep.png](sweep.png)" in md


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_without_matplotlib_the_report_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib -> ImportError
    recs = records("rate 1/s")
    files = report.write_all(build([(1, recs, None)]), recs, tmp_path)
    assert {f.name for f in files} == {"report.json", "report.md", "requests.jsonl"}
    md = (tmp_path / "report.md").read_text()
    assert "No plots: matplotlib is not installed" in md
    assert "Not run (pass `--baselines`)" in md
    assert json.loads((tmp_path / "report.json").read_text())["plots"] == []


def test_mismatches_are_reported_prominently(tmp_path):
    recs = records("rate 1/s")
    audit = AuditSummary(exact=4, mismatch=1, mismatches=[dict(level="rate 1/s", index=3, workload="single",
                                                              prompt="prompt 3", params={}, seed=9,
                                                              detail="output token 0 is not the reference's choice")])
    rep = build([(1, recs, audit)])
    files = report.write_all(rep, recs, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "**1 MISMATCH(ES) FOUND BY THE AUDIT**" in md
    assert "output token 0 is not the reference's choice" in md
    lines: list[str] = []
    print_summary(rep, files, lines.append)
    assert any("1 MISMATCH(ES)" in line for line in lines)
    assert any(line.startswith("rate 1/s") and "4/0/1 (20.00%)" in line for line in lines)


def test_progress_line_counts_and_prints_sparingly_off_a_terminal():
    out = io.StringIO()
    bar = Progress("rate 1/s", total=4, stream=out)
    for r in records("rate 1/s", 4):
        bar.update(r)
    bar.close()
    lines = out.getvalue().splitlines()
    assert 1 <= len(lines) <= 3                                  # not one line per request
    assert "4/4 req" in lines[-1] and "err 1" in lines[-1] and "#" * 24 in lines[-1]
    quiet = io.StringIO()
    Progress("x", total=1, stream=quiet, enabled=False).close()
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("value,text", [(None, "–"), (1234.5, "1,234.5"), (3, "3")])
def test_fmt(value, text):
    assert report.fmt(value) == text


def test_baseline_ratio_is_the_median_of_per_repeat_ratios():
    from tether.loadtest.results import median_ratio
    assert median_ratio([10.0, 30.0, 12.0], [20.0, 20.0, 12.0]) == pytest.approx(1.0)
    assert median_ratio([10.0], []) is None


def test_the_llama_cpp_baseline_shows_its_latency_command_and_ratio(tmp_path):
    recs = records("rate 1/s")
    measured = dict(BASELINES, served=dict(BASELINES["served"], ttft_p50_ms=120.0, tpot_p50_ms=30.0),
                    llama_cpp=dict(output_token_throughput=100.0, runs=[80.0, 120.0], ttft_p50_ms=900.0,
                                   tpot_p50_ms=9.0),
                    llama_cpp_threads=2, llama_cpp_command="/venv/bin/python -m llama_cpp.server --n_threads 2",
                    ratios=dict(BASELINES["ratios"], vs_llama_cpp=0.5))
    report.write_all(build([(1, recs, None)], measured), recs, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| served | tether, served over gRPC (closed loop, concurrency = batch size) | 50.0 | 120 | 30 |" in md
    assert "2 thread(s); serializes requests), over its OpenAI API at concurrency = batch size | 100.0 | 900 | 9 |" in md
    assert "The llama.cpp server: `/venv/bin/python -m llama_cpp.server --n_threads 2`." in md
    assert "tether / llama.cpp = **0.50×**" in md
