"""The tagger on a conversation: its structure is given (turns, system prompt), its contents are tagged."""

from __future__ import annotations

import math
import time

import pytest

from services.admission.tagger import compute_prefix_key, tag, tag_conversation

SYSTEM = "You are a careful medical assistant."


def test_single_turn_tags_like_the_same_prompt():
    prompt = "请用不超过50字向老人解释血糖仪读数"
    conv = tag_conversation([("user", prompt)], 10, 200, tokens_per_char=1.0)
    raw = tag(prompt, 10, 200, tokens_per_char=1.0)
    assert conv == raw
    assert conv.turns == 1 and conv.prefix_key == 0 and conv.task == "qa"
    assert (conv.length_limit, conv.length_unit, conv.audience, conv.domain) == (50, "chars", "elderly", "medical")


def test_turns_are_user_messages_and_multi_turn_is_chat():
    t = tag_conversation([("system", SYSTEM), ("user", "Translate 'hi' to French"), ("assistant", "Salut"),
                          ("user", "And to German?")], 40, 64)
    assert t.turns == 2 and t.task == "chat"
    # Role words inside contents are content, not structure: no extra turns.
    assert tag_conversation([("user", "User: a\nUser: b\nUser: c")], 5, 64).turns == 1


def test_system_message_is_the_prefix_key():
    a = tag_conversation([("system", SYSTEM), ("user", "hi")], 5, 64)
    b = tag_conversation([("system", "  " + SYSTEM + "\n"), ("user", "something else"), ("assistant", "ok"),
                          ("user", "more")], 5, 64)
    assert a.prefix_key == b.prefix_key == compute_prefix_key(SYSTEM) != 0
    assert tag_conversation([("user", "hi")], 5, 64).prefix_key == 0


def test_length_constraint_comes_from_the_system_and_the_last_user_message():
    earlier = [("user", "Answer in under 10 words: why is the sky blue?"), ("assistant", "Scattering."),
               ("user", "Now explain it properly.")]
    assert tag_conversation(earlier, 30, 300).length_limit == 0      # the old limit was for the old answer
    assert tag_conversation(earlier, 30, 300).output_budget == 300
    last = earlier[:-1] + [("user", "Now in at most 40 words.")]
    assert (tag_conversation(last, 30, 300).length_limit, tag_conversation(last, 30, 300).length_unit) == (40, "words")
    system = [("system", "Always answer in under 20 words."), *earlier]
    assert tag_conversation(system, 30, 300).length_limit == 20


def test_contents_not_assistant_words_decide_language_and_domain():
    t = tag_conversation([("user", "你好，请问血压高怎么办？"), ("assistant", "Take your medication and see a doctor."),
                          ("user", "谢谢")], 30, 64)
    assert t.language == "zh" and t.domain == "medical"


def test_bad_sizes_are_value_errors():
    with pytest.raises(ValueError, match="max_tokens"):
        tag_conversation([("user", "x")], 1, 0)
    with pytest.raises(ValueError, match="priority"):
        tag_conversation([("user", "x")], 1, 1, priority="urgent")


def _cpu(messages) -> float:
    best = math.inf
    for _ in range(3):
        start = time.thread_time()
        tag_conversation(messages, 1, 1024)
        best = min(best, time.thread_time() - start)
    return best


def test_linear_in_the_number_and_size_of_messages():
    # Linear ~8x for 8x the messages; quadratic would be ~64x.
    turn = [("user", "under one hundred hundred words 不超过一二三十百字 血糖 " * 4), ("assistant", "ok " * 20)]
    small, big = turn * 16, turn * 128
    ratio = _cpu(big) / max(_cpu(small), 1e-6)
    assert ratio < 20, f"ratio {ratio:.1f}"
