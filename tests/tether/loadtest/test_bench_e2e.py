"""`tether bench` against real clusters on loopback: as a user runs it (--spawn, a subprocess), against a
running cluster (--target), and the audit catching an answer delivered for the wrong request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from tether import reference
from tether.loadtest import audit, loadgen
from tether.loadtest.baselines import torch_threads
from tether.loadtest.cli import build_parser
from tether.loadtest.cli import main as bench_main
from tether.loadtest.workloads import BenchRequest
from tether.client import AsyncClient
from tether.model.loader import resolve_model

TETHER = [sys.executable, "-m", "tether.cli.main"]




def test_help_explains_every_option():
    out = subprocess.run(TETHER + ["bench", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: tether bench" in out.stdout
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"
        for flag in action.option_strings:
            assert flag in out.stdout


def test_bench_spawns_a_cluster_and_writes_an_audited_report(tmp_path):
    out_dir = tmp_path / "bench-out"
    run = subprocess.run(TETHER + ["bench", "--spawn", "--model", "tiny", "--concurrency", "4", "--num-requests", "4", "--warmup", "1",
                                   "--audit", "--slo", "ttft:10000,tpot:2000", "--baselines",
                                   "--baseline-requests", "4", "--batch-size", "4", "--out", str(out_dir)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in ("report.json", "report.md", "requests.jsonl"):
        assert (out_dir / name).is_file()
    rep = json.loads((out_dir / "report.json").read_text())
    level = rep["levels"][0]
    assert level["summary"]["requests"] == 4
    # batch invariance: every served token is the reference's own choice, not one within float noise of it
    assert level["audit"]["audited"] == level["summary"]["completed"] == level["audit"]["exact"] == 4, level["audit"]
    assert level["audit"]["within_margin"] == level["audit"]["mismatch"] == 0, level["audit"]["mismatches"]
    assert not rep["chaos"]["requested"] and "not requested" in rep["chaos"]["reason"]
    b = rep["baselines"]
    assert b["completed"] == 4 and b["ratios"]["vs_engine"] > 0
    assert b["hf"]["output_token_throughput"] > 0 and b["ratios"]["vs_hf"] > 0
    assert b["hf_cb"]["output_token_throughput"] > 0 and b["ratios"]["vs_hf_cb"] > 0   # generate_batch ran
    assert "has no GGUF" in b["llama_cpp"]["error"] and b["ratios"]["vs_llama_cpp"] is None   # tiny: skipped
    assert "tether/engine" in run.stdout and "report.md" in run.stdout
    assert "warm-up" in run.stderr and "concurrency 4" in run.stderr        # the progress line
    assert (out_dir / "logs" / "admission.log").is_file()


def test_bench_against_a_running_cluster_in_open_loop(cluster, tmp_path):
    bench_main(["--target", cluster.target, "--model", "tiny", "--rate", "8", "--num-requests", "6", "--warmup", "1",
                "--workload", "synthetic", "--input-len", "32", "--output-len", "8", "--audit", "--quiet",
                "--out", str(tmp_path)])
    rep = json.loads((tmp_path / "report.json").read_text())
    level = rep["levels"][0]
    assert level["mode"] == "open" and level["summary"]["completed"] == 6
    assert level["audit"]["audited"] == level["audit"]["exact"] == 6, level["audit"]    # exact, not within margin
    assert level["summary"]["latency_ms"]["tpot"]["count"] == 6       # synthetic ignores EOS: 4..12 tokens each
    assert not rep["meta"]["spawned"] and rep["meta"]["target"] == cluster.target


def test_the_audit_flags_a_served_answer_delivered_for_another_request(cluster):
    requests = [BenchRequest(0, "single", "你好，今天适合去爬山吗？", 12, temperature=1.0, top_p=0.9),  # unseeded
                BenchRequest(1, "single", "Explain in under 30 words why the sky is blue.", 12)]

    async def send():
        async with AsyncClient(cluster.target, timeout=60) as client:
            return await asyncio.gather(*(loadgen.run_request(client, r, "t", 0.0) for r in requests))

    a, b = asyncio.run(send())
    assert a.ok and b.ok and a.seed != 0            # admission drew the seed the audit has to use
    with torch_threads(1):
        lm = reference.load("tiny")
        assert audit.audit_record(lm, a) == (reference.EXACT, "")      # the service promises exact tokens
        assert audit.audit_record(lm, b) == (reference.EXACT, "")
        for answer, request in ((a, b.request), (b, a.request)):
            verdict, detail = audit.audit_record(lm, dataclasses.replace(answer, request=request))
            assert verdict == reference.MISMATCH, detail


def test_bench_refuses_a_cluster_serving_another_model(cluster, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(resolve_model("tiny"), other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "note": "not what the cluster serves"}))
    with pytest.raises(SystemExit, match="serves model .* pass the served model with --model"):
        bench_main(["--target", cluster.target, "--model", str(other), "--num-requests", "1", "--warmup", "1",
                    "--quiet", "--out", str(tmp_path / "out")])
