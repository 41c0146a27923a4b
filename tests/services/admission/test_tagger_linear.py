"""The tagger reads untrusted prompts at the front door: linear time, and no exception from prompt text.

Timing tests measure the thread's CPU time (not wall time: the machine is shared)
of the whole ``tag()`` on a prompt of size n and of size 8n, interleaved, min of
repeats. Linear code gives a ratio near 8, quadratic near 64; the bound is 20.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.admission.tagger import (
    MAX_LENGTH_LIMIT,
    detect_audience,
    find_length_constraints,
    implied_budget,
    tag,
)

MAX_RATIO = 20.0  # linear ~8, quadratic ~64
REPEATS = 5
TARGET_S = 0.025  # the 8n run takes at least this, so timer noise stays small
START_CHARS = 1024  # n of the first try; doubled until the 8n run reaches TARGET_S
MAX_BIG_CHARS = 1 << 20  # a prompt this big and still under TARGET_S is cheap enough

# Pieces of every rule's alphabet. Repeated, they build the long runs a backtracking
# regex rescans from every position: number words, digits, numerals, prefixes,
# units, role markers, template tags, whitespace.
PIECES: tuple[str, ...] = (
    "one ", "one-", "and ", "one and ", "hundred ", "twenty  ", "seventeen-",
    "1", "1 ", ",000", "12,345 ",
    "一二三十百千万亿两零", "万", "两", "零",
    "不超过", "不超过 ", "用", "字数在", "字数", "限",
    "under ", "at most ", "max of ", "fewer than ", "in ",
    "字", "个字", "句话", "以内", "岁", "words ", "word", "-word", "tokens ", "years ", "year-", "old ",
    "one 一 1 字 words 不超过 ",
    "User: hi\n", "用户：你好\n", "\nAssistant:", "System:", "\nsystem ",
    "<<SYS>>", "<s>[INST] ", "[/INST]",
    " ", "\t", "\n", "\n \n", "　",
    "blood sugar code 血糖 ",
    # the rules of issue 12 part 5: per-item caps, ranges, readers, translation cues, mixed scripts
    "each ", "each in ", "每条", "每个标题", "a ", "a dozen ", "or ", "two or ", "2-", "三到",
    "for ", "as a ", "senior ", "engineers", "面向", "我是一名", "的", "'s ", "of the ",
    "render ", " in french", "是什么意思", "x ", "用Python写", "TypeError: ", "(a, b)", "。",
)

# (head, repeated body, tail): the classic shape is a prefix, one long run, then
# the text that would complete a match (a unit, "years old").
SHAPES: list[tuple[str, str, str]] = [
    ("", "one ", "words or less"),
    ("answer in under ", "hundred ", "words"),
    ("", "one-", "word summary"),
    ("", "one and ", "years old"),
    ("in ", "twenty  ", "sentences"),
    ("", "1", " words or less"),
    ("under ", "1", " words"),
    ("", "1", "字以内"),
    ("1", ",000", " words or less"),
    ("不超过", "万", "字"),
    ("", "一二三十百千万亿两零", "岁"),
    ("不超过", " ", "50字"),
    ("字数在5", " ", "字以内"),
    ("", "不超过", "5字"),
    ("", "under ", "5 words"),
    ("", "at most ", ""),
    ("", "words ", ""),
    ("", "one 一 1 字 words 不超过 ", ""),
    ("System: be brief\n", "User: hi\n", ""),
    ("", "用户：你好\n", ""),
    ("<<SYS>>", "x", ""),
    ("<s>[INST] ", " ", "<<SYS>>"),
    ("", " ", ""),
    ("\n", " \t", "User:"),
    ("", "blood sugar code 血糖 ", ""),
    ("list four tips, ", "each ", "under 5 words"),
    ("列出三条建议，", "每条", "不超过5字"),
    ("in ", "two or ", "three sentences"),
    ("under ", "a ", "dozen words"),
    ("for ", "senior ", "engineers"),
    ("面向", "资深", "工程师"),
    ("", "of the ", "kids"),
    ("render ", "x ", " in french"),
    ("", "hello ", "是什么意思"),
    ("", "用Python写", ""),
    ("翻译：", "x ", ""),
    ("", "TypeError: (a, b) ", ""),
]


def _cpu_time(prompt: str) -> float:
    start = time.thread_time()
    tag(prompt, 1, 1024)
    return time.thread_time() - start


def _growth(make: Callable[[int], str]) -> tuple[float, str]:
    """CPU-time ratio of tag() on make(8k) over make(k), with k big enough to time well."""
    k = max(1, START_CHARS // max(1, len(make(1))))
    while len(make(8 * k)) < MAX_BIG_CHARS and _cpu_time(make(8 * k)) < TARGET_S:
        k *= 2
    small, big = make(k), make(8 * k)
    t_small = t_big = math.inf
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection landing in one run would skew the ratio
    try:
        for _ in range(REPEATS):  # interleaved: a busy spell hits both sizes alike
            t_small = min(t_small, _cpu_time(small))
            t_big = min(t_big, _cpu_time(big))
    finally:
        if gc_was_enabled:
            gc.enable()
    ratio = t_big / max(t_small, 1e-6)
    detail = (f"{len(small)} chars: {t_small * 1e3:.2f} ms, {len(big)} chars: {t_big * 1e3:.2f} ms, "
              f"ratio {ratio:.1f} (linear ~8); prompt starts {big[:60]!r}")
    return ratio, detail


def _shape(head: str, body: str, tail: str) -> Callable[[int], str]:
    return lambda k: head + body * k + tail


@pytest.mark.parametrize("head,body,tail", SHAPES, ids=[f"{i}-{body!r}" for i, (_, body, _) in enumerate(SHAPES)])
def test_tag_is_linear_on_long_runs(head: str, body: str, tail: str) -> None:
    ratio, detail = _growth(_shape(head, body, tail))
    assert ratio < MAX_RATIO, detail


def test_tag_is_linear_with_many_distinct_constraints() -> None:
    # Thousands of different limits: deduplicating them must not be quadratic either.
    ratio, detail = _growth(lambda k: "".join(f"不超过{i}字，" for i in range(1, k + 1)))
    assert ratio < MAX_RATIO, detail


_piece_runs = st.lists(st.sampled_from(PIECES), min_size=0, max_size=3).map("".join)


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(head=_piece_runs, body=st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map("".join),
       tail=_piece_runs)
def test_tag_time_grows_linearly_on_any_mix(head: str, body: str, tail: str) -> None:
    ratio, detail = _growth(_shape(head, body, tail))
    assert ratio < MAX_RATIO, detail


# ---------------------------------------------------------------- no exception from prompt text


@pytest.mark.parametrize(
    "prompt",
    [
        "answer in under " + "hundred " * 500 + "words",
        "answer in under " + "hundred " * 9 + "words",  # few enough words to parse: 10**18, over the cap
        "不超过" + "万" * 500 + "字",
        "不超过" + "亿" * 12 + "字",  # few enough numerals to parse: 1.2e9, over the cap
        "under " + "9" * 500 + " words",
        "under 999999999999 words",
        "under 1,000,001 words",
        "1" + ",000" * 200 + " words or less",
        "123456789012345 words or less",  # not its last 12 digits either
        "12,345,678,901,234 words or less",
        "one " * 20 + "words or less",  # not its last few words either
        "不超过" + "一" * 20 + "字",
    ],
)
def test_absurd_limits_are_ignored(prompt: str) -> None:
    t = tag(prompt, 5, 256)
    assert (t.length_limit, t.length_unit) == (0, "")
    assert t.output_budget == 256
    assert find_length_constraints(prompt) == []


def test_limits_up_to_the_cap_are_kept() -> None:
    assert find_length_constraints("under 1,000,000 words") == [(MAX_LENGTH_LIMIT, "words")]
    assert find_length_constraints("不超过一百万字") == [(MAX_LENGTH_LIMIT, "chars")]
    nines = "in under nine hundred ninety-nine thousand nine hundred ninety-nine words"
    assert find_length_constraints(nines) == [(999_999, "words")]
    assert tag("under 1,000,000 words", 5, 256).output_budget == 256


def test_number_runs_are_not_ages() -> None:
    assert detect_audience("one " * 20 + "years old") == "general"  # not "eight years old"
    assert detect_audience("my grandpa is ninety-five years old") == "elderly"
    assert detect_audience("a 5-year-old") == "child"


def test_implied_budget_cannot_overflow() -> None:
    assert implied_budget(10**400, "words") == implied_budget(MAX_LENGTH_LIMIT, "words")
    assert implied_budget(10, "chars", tokens_per_char=1e308) == 2**63 - 1
    with pytest.raises(ValueError, match="tokens_per_char"):
        tag("不超过50字", 1, 10, tokens_per_char=math.inf)


def test_lone_surrogates_do_not_raise() -> None:
    assert tag("<<SYS>>\ud800<</SYS>> hi", 1, 10).prefix_key != 0
    assert tag("System: \udfff\n\nhi", 1, 10).prefix_key != 0


_prompt_text = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=4)), max_size=40).map("".join)


@settings(max_examples=300, deadline=None, database=None)
@given(prompt=_prompt_text, max_tokens=st.integers(1, 4096), tokens_per_char=st.floats(0.01, 4.0))
def test_tag_never_raises_on_prompt_text(prompt: str, max_tokens: int, tokens_per_char: float) -> None:
    t = tag(prompt, 1, max_tokens, tokens_per_char=tokens_per_char)
    assert 1 <= t.output_budget <= max_tokens
    assert 0 <= t.length_limit <= MAX_LENGTH_LIMIT
    assert (t.length_limit == 0) == (t.length_unit == "")
