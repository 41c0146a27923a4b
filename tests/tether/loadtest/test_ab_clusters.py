"""bench/ab_clusters.py's pure parts: each side's flags and variables as given, and the pairs' summary. Nothing
is started here (the tool itself starts two clusters)."""

from __future__ import annotations

import pytest

from bench.ab_clusters import pairs_summary, parse_env, parse_flags


def test_flags_go_to_their_side_and_role_split_as_a_shell_would():
    extra = parse_flags(["b:coordinator:--alone-max-requests 0", "b:coordinator:--max-batch-tokens 16",
                         "a:stage:--linear-inputs q8", "b:admission:--tenant 'x y'"])
    assert extra == {"a": {"stage": ["--linear-inputs", "q8"]},
                     "b": {"coordinator": ["--alone-max-requests", "0", "--max-batch-tokens", "16"],
                           "admission": ["--tenant", "x y"]}}
    assert parse_flags([]) == {"a": {}, "b": {}}


@pytest.mark.parametrize("item", ["c:stage:--x", "a:stages:--x", "a:stage:", "a:stage", "stage:--x", "a::--x"])
def test_a_flag_without_a_side_a_role_or_flags_is_refused(item):
    with pytest.raises(ValueError, match="SIDE:ROLE:FLAGS"):
        parse_flags([item])


def test_variables_go_to_their_side_and_keep_what_follows_the_first_equals():
    assert parse_env(["b:TETHER_KERNELS_ISA=avx2", "a:X=1=2", "a:EMPTY="]) == {
        "a": {"X": "1=2", "EMPTY": ""}, "b": {"TETHER_KERNELS_ISA": "avx2"}}
    for item in ["c:X=1", "a:X", "a:=1", "X=1", "a:1X=2"]:
        with pytest.raises(ValueError, match="SIDE:NAME=VALUE"):
            parse_env([item])


def test_the_summary_is_each_pairs_b_over_a_and_the_medians():
    s = pairs_summary([200.0, 210.0, 190.0], [220.0, 210.0, 209.0])
    assert s["ratios"] == pytest.approx([1.1, 1.0, 1.1])
    assert (s["a"], s["b"], s["ratio"]) == (200.0, 210.0, pytest.approx(1.1))
    assert pairs_summary([0.0, 100.0], [5.0, 50.0])["ratios"] == [0.5]   # a run that read nothing: no ratio
    assert pairs_summary([], []) == dict(a=None, b=None, ratios=[], ratio=None)
