"""bench/memory.py's pure parts: checkpoint parsing, RSS growth and the pass/fail verdict."""

from __future__ import annotations

import argparse

import pytest

from bench.memory import _checkpoints, build_parser, growth, verdict


def test_checkpoints_parse_increasing_counts():
    assert _checkpoints("1000,10000") == [1000, 10000]
    assert build_parser().parse_args([]).checkpoints == [1000, 10000]
    for bad in ("", "x", "0,10", "10,10", "100,50"):
        with pytest.raises(argparse.ArgumentTypeError):
            _checkpoints(bad)


def test_growth():
    assert growth(100, 110) == pytest.approx(0.10)
    assert growth(None, 5) is None and growth(100, None) is None and growth(0, 5) is None


def test_verdict_judges_stages_only_and_counts_failures_and_exits():
    rss = {"stage0": [1000, 1050], "stage1": [1000, 1200], "admission": [1000, 3000], "stage0/child-9": [10, 90]}
    problems = verdict(rss, 0.10, failed=0, exited=[])
    assert problems == ["stage1 RSS grew +20.0% (limit 10%)"]
    assert verdict({"stage0": [1000, 1099]}, 0.10, 0, []) == []
    assert verdict({"stage0": [1000, None]}, 0.10, 2, ["stage0"]) == [
        "stage0 RSS grew ? (limit 10%)", "2 request(s) failed", "stage0 exited"]


def test_pool_fill_and_cache_line():
    from bench.memory import cache_line, pool_fill
    stage = dict(address="127.0.0.1:1", kv_blocks_used=10, kv_blocks_cached=40, kv_blocks_total=100,
                 prefix_evictions=3, prefix_hits=1, prefix_queries=2)
    old = dict(stage, kv_blocks_total=0)
    assert pool_fill(dict(stages=[stage, old, None])) == [0.5, None, None]
    assert cache_line(dict(stages=[stage])) == "127.0.0.1:1: 40/100 blocks cached, 3 evicted, 1/2 hits"
    assert cache_line(dict(stages=[None])) == "stage Stats not read"
