"""The fidelity audit: served answers replayed through the in-process reference, and answers that do not
belong to their request (another request's tokens, a cut, a wrong seed or budget) flagged MISMATCH."""

from __future__ import annotations

import dataclasses

import pytest

from tether import reference
from tether.loadtest import audit
from tether.loadtest.baselines import torch_threads
from tether.loadtest.records import RequestRecord
from tether.loadtest.workloads import BenchRequest

GREEDY = dict(max_tokens=12)
SAMPLED = dict(max_tokens=12, temperature=1.0, top_p=0.9, seed=4242)


@pytest.fixture(scope="module")
def lm():
    # One thread: on a shared 2-core machine a second OpenMP thread makes the reference ~100x slower.
    with torch_threads(1):
        yield reference.load("tiny")


def served(prompt: str, tags: dict | None = None, as_request: BenchRequest | None = None, **params) -> RequestRecord:
    """A record as the load generator would keep it, with the reference's answer standing in for the server's."""
    r = reference.generate(prompt, "tiny", **params)
    req = as_request or BenchRequest(0, "single", prompt, **params)
    rec = RequestRecord(req, "test", ttft=0.01, e2e=0.1)
    rec.token_ids, rec.text, rec.finish_reason, rec.seed = r.token_ids, r.text, r.finish_reason, r.seed
    rec.tags = tags or {"output_budget": params["max_tokens"]}
    rec.prompt_tokens, rec.context_hash = r.receipt.prompt_tokens, r.receipt.context_hash
    return rec


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_references_own_answer_is_exact(lm, params):
    assert audit.audit_record(lm, served("请用不超过50字向老人解释血糖仪读数", **params)) == (reference.EXACT, "")


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_an_answer_paired_with_another_requests_prompt_is_a_mismatch(lm, params):
    a = served("你好", **params)
    b = served("Explain in under 30 words why the sky is blue.", **params)
    assert a.token_ids != b.token_ids
    crossed = dataclasses.replace(b, request=a.request)       # b's answer delivered for a's question
    verdict, detail = audit.audit_record(lm, crossed)
    assert verdict == reference.MISMATCH
    assert "not the reference's choice" in detail


def test_the_seed_the_server_drew_is_the_one_audited(lm):
    req = BenchRequest(0, "single", "写一首关于秋天的短诗", max_tokens=16, temperature=0.8)   # unseeded
    rec = served(req.prompt, as_request=req, max_tokens=16, temperature=0.8, seed=987654321)
    assert rec.seed == 987654321
    assert audit.audit_record(lm, rec)[0] == reference.EXACT
    rec.seed = 11
    assert audit.audit_record(lm, rec)[0] == reference.MISMATCH


def test_admissions_output_budget_is_the_length_audited(lm):
    req = BenchRequest(0, "single", "In at most 3 sentences, explain compound interest.", max_tokens=64)
    rec = served(req.prompt, as_request=req, tags={"output_budget": 6}, max_tokens=6)
    assert audit.audit_record(lm, rec)[0] == reference.EXACT
    rec.tags = {}
    verdict, detail = audit.audit_record(lm, rec)
    assert verdict == reference.MISMATCH and "finish reason" in detail


def test_cut_or_relabelled_answers_and_false_receipts_are_mismatches(lm):
    rec = served("你好", **GREEDY)
    cut = dataclasses.replace(rec, token_ids=rec.token_ids[:-1])
    assert audit.audit_record(lm, cut)[0] == reference.MISMATCH
    assert audit.audit_record(lm, dataclasses.replace(rec, finish_reason="eos"))[0] == reference.MISMATCH
    assert audit.audit_record(lm, dataclasses.replace(rec, text=rec.text + "x"))[0] == reference.MISMATCH
    for false_receipt in (dict(prompt_tokens=rec.prompt_tokens + 1), dict(context_hash=rec.context_hash ^ 1)):
        assert audit.audit_record(lm, dataclasses.replace(rec, **false_receipt))[0] == reference.MISMATCH


def test_audit_records_counts_verdicts_and_skips_failures(lm):
    good = served("你好", **GREEDY)
    other = served("Explain in under 30 words why the sky is blue.", **GREEDY)
    crossed = dataclasses.replace(other, request=good.request)
    failed = RequestRecord(good.request, "test", error_code="UNAVAILABLE")
    summary = audit.audit_records(lm, [good, crossed, failed])
    assert (summary.exact, summary.within_margin, summary.mismatch, summary.audited) == (1, 0, 1, 2)
    assert summary.mismatch_rate == 0.5
    assert crossed.verdict == reference.MISMATCH and failed.verdict == ""
    assert summary.to_json()["mismatches"][0]["prompt"] == "你好"
