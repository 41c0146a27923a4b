"""Workload generators: seeded, the mix and length distributions asked for, and prompts admission reads as
intended (length constraints, multi-turn with shared system prompts)."""

from __future__ import annotations

from collections import Counter

import pytest

from services.admission import tagger
from tether.loadtest.workloads import LongSpec, SyntheticSpec, Workload, parse_mix
from tether.model.loader import load_model_tokenizer, resolve_model


@pytest.fixture(scope="module")
def encode():
    return load_model_tokenizer(resolve_model("tiny")).encode


def test_parse_mix():
    assert parse_mix("mix") == {"single": 6.0, "multiturn": 3.0, "long": 1.0}
    assert parse_mix("synthetic") == {"synthetic": 1.0}
    assert parse_mix("single:2, long:0.5") == {"single": 2.0, "long": 0.5}
    for bad in ("", "chat", "single:x", "single:0"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_same_seed_same_requests_other_seed_other_requests(encode):
    w = Workload(parse_mix("single,multiturn,long,synthetic"), encode, SyntheticSpec(64, 16), LongSpec(300, 400))
    a, b, c = w.take(40, 1), w.take(40, 1), w.take(40, 2)
    assert a == b
    assert a != c
    assert [r.index for r in a] == list(range(40))


def test_mix_weights_are_respected(encode):
    w = Workload({"single": 3.0, "multiturn": 1.0}, encode)
    counts = Counter(r.workload for r in w.take(2000, 0))
    assert set(counts) == {"single", "multiturn"}
    assert counts["single"] / 2000 == pytest.approx(0.75, abs=0.04)


def test_about_half_the_requests_sample_with_an_explicit_seed(encode):
    reqs = Workload({"single": 1.0}, encode).take(1000, 0)
    sampled = [r for r in reqs if r.temperature > 0]
    assert len(sampled) / 1000 == pytest.approx(0.5, abs=0.05)
    assert all(r.seed > 0 for r in sampled) and all(r.seed == 0 for r in reqs if r.temperature == 0)


def test_synthetic_lengths_are_uniform_in_the_range(encode):
    spec = SyntheticSpec(input_len=100, output_len=40, range_ratio=0.5)
    reqs = Workload({"synthetic": 1.0}, encode, spec).take(400, 0)
    n_in = [len(encode(r.prompt)) for r in reqs]
    n_out = [r.max_tokens for r in reqs]
    assert min(n_in) >= 50 and max(n_in) <= 150
    assert min(n_out) >= 20 and max(n_out) <= 60
    assert sum(n_in) / len(n_in) == pytest.approx(100, rel=0.06)
    assert sum(n_out) / len(n_out) == pytest.approx(40, rel=0.06)
    # uniform, not bunched: each third of the range gets about a third of the requests
    thirds = Counter(min(2, (n - 20) * 3 // 41) for n in n_out)
    assert all(abs(thirds[k] / 400 - 1 / 3) < 0.08 for k in range(3))
    assert all(r.ignore_eos for r in reqs)
    fixed = Workload({"synthetic": 1.0}, encode, SyntheticSpec(64, 8, 0.0)).take(20, 0)
    assert {len(encode(r.prompt)) for r in fixed} == {64} and {r.max_tokens for r in fixed} == {8}


def test_long_requests_fill_their_context_range(encode):
    reqs = Workload({"long": 1.0}, encode, long=LongSpec(800, 1200)).take(30, 0)
    lengths = [len(encode(r.prompt)) for r in reqs]
    # whole passages are added while they fit, so a prompt ends at most one passage short of its target
    assert min(lengths) >= 800 - 600 and max(lengths) <= 1200
    assert {tagger.detect_language(r.prompt) for r in reqs} == {"zh", "en"}


def test_single_prompts_carry_length_constraints_in_both_languages(encode):
    reqs = Workload({"single": 1.0}, encode).take(400, 0)
    constrained = {tagger.detect_language(r.prompt) for r in reqs if tagger.parse_length_constraint(r.prompt)[0]}
    assert constrained == {"zh", "en"}
    assert any("不超过50字" in r.prompt for r in reqs)
    assert len({r.prompt for r in reqs}) >= 30        # varied, not a handful of prompts


def test_multiturn_requests_share_system_prompts_and_end_on_the_assistant(encode):
    reqs = Workload({"multiturn": 1.0}, encode).take(200, 0)
    keys = Counter(tagger.compute_prefix_key(tagger.extract_system_prompt(r.prompt)) for r in reqs)
    assert 0 not in keys
    assert 2 <= len(keys) <= 6 and max(keys.values()) >= 30       # a few system prompts, each shared widely
    turns = {tagger.count_turns(r.prompt) for r in reqs}
    assert 1 in turns and max(turns) >= 4
    assert all(r.prompt.endswith(("Assistant:", "助手：")) for r in reqs)
