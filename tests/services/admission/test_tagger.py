"""Unit tests for the rule-based admission tagger (pure logic, no model)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from services.admission.tagger import (
    BUDGET_RULES,
    Tags,
    chinese_numeral_to_int,
    classify_size,
    compute_output_budget,
    compute_prefix_key,
    count_lexicon_hits,
    count_turns,
    detect_audience,
    detect_domain,
    detect_language,
    detect_task,
    english_numeral_to_int,
    extract_system_prompt,
    find_length_constraints,
    implied_budget,
    parse_length_constraint,
    parse_number,
    strip_role_markers,
    tag,
)
from tether.priority import parse as parse_priority

# ---------------------------------------------------------------- end to end


def test_chinese_elderly_medical_prompt() -> None:
    t = tag("请用不超过50字向老人解释血糖仪读数", input_tokens=20, max_tokens=256)
    assert t.language == "zh"
    assert (t.length_limit, t.length_unit) == (50, "chars")
    assert t.domain == "medical"
    assert t.audience == "elderly"
    assert t.task == "qa"
    assert t.output_budget < 256
    assert t.output_budget == 83  # ceil(50 * 1.0 * 1.5 + 8)
    assert t.size_class == "medium"
    assert t.turns == 1
    assert t.prefix_key == 0
    assert t.priority == "standard"
    assert t.input_tokens == 20


def test_english_contract_summary() -> None:
    t = tag("Summarize this contract in under 50 words", input_tokens=12, max_tokens=256)
    assert t.language == "en"
    assert (t.length_limit, t.length_unit) == (50, "words")
    assert t.task == "summarize"
    assert t.domain == "legal"
    assert t.audience == "general"
    assert t.output_budget == 108  # 50 * 2 + 8


def test_tags_is_frozen_and_carries_tenant() -> None:
    t = tag("hello", 1, 16, tenant="acme", priority="critical")
    assert isinstance(t, Tags)
    assert t.tenant == "acme"
    assert t.priority == "critical"
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.tenant = "other"  # type: ignore[misc]


def test_no_constraint_keeps_max_tokens() -> None:
    t = tag("What is the capital of France?", 8, 300)
    assert (t.length_limit, t.length_unit) == (0, "")
    assert t.output_budget == 300
    assert t.task == "qa"
    assert t.domain == "general"


@pytest.mark.parametrize(
    "prompt",
    [
        "用不超过一千字介绍长城",
        "Write at most 500 words about rivers",
        "Answer in under 1000 sentences",
        "max 9000 tokens please",
    ],
)
def test_budget_never_exceeds_max_tokens(prompt: str) -> None:
    for max_tokens in (1, 10, 64, 100):
        t = tag(prompt, 5, max_tokens)
        assert 1 <= t.output_budget <= max_tokens
        assert t.length_limit > 0  # the constraint was found, max_tokens capped it


def test_tokens_per_char_scales_char_budget() -> None:
    assert tag("不超过100字", 5, 1000, tokens_per_char=1.0).output_budget == 158
    assert tag("不超过100字", 5, 1000, tokens_per_char=0.5).output_budget == 83
    assert tag("不超过100字", 5, 1000, tokens_per_char=2.0).output_budget == 308


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        tag("hi", 1, 0)
    with pytest.raises(ValueError, match="input_tokens"):
        tag("hi", -1, 10)
    with pytest.raises(ValueError, match="tokens_per_char"):
        tag("hi", 1, 10, tokens_per_char=0.0)


# ---------------------------------------------------------------- priority


@pytest.mark.parametrize("given,expected", [("", "standard"), ("critical", "critical"),
                                            ("standard", "standard"), ("sheddable", "sheddable"),
                                            (" Critical ", "critical")])
def test_priority_accepted(given: str, expected: str) -> None:
    assert parse_priority(given) == expected
    assert tag("hi", 1, 10, priority=given).priority == expected


def test_priority_rejected_with_readable_message() -> None:
    with pytest.raises(ValueError) as info:
        tag("hi", 1, 10, priority="urgent")
    message = str(info.value)
    assert "critical, standard, sheddable" in message
    assert "'urgent'" in message


# ---------------------------------------------------------------- language


@pytest.mark.parametrize(
    "text,expected",
    [
        ("你好，世界", "zh"),
        ("Hello, world", "en"),
        # Was "mixed" (6 ideographs vs 6 letters); a reader sees a Chinese sentence naming Python (issue 12).
        ("用python写一个函数", "zh"),
        # Was "mixed"; an English term inside a Chinese sentence leaves it Chinese.
        ("请解释一下 machine learning 的原理", "zh"),
        ("把下面这段话翻译成中文：Machine learning models need lots of labelled data to generalise.", "mixed"),
        ("Java里的HashMap和TreeMap有什么区别？", "zh"),
        ("这段代码报错KeyError: 'id' is missing，怎么办？", "zh"),
        ("请解释 GPU 的原理和用途是什么", "zh"),  # a few Latin letters stay below 30%
        ("Explain 机器学习 in simple terms please", "en"),
        ("12345 !!! ???", "other"),
        ("", "other"),
        ("Привет мир", "other"),
        ("ＦＵＬＬ ｗｉｄｔｈ", "en"),
        ("ラーメンを食べたい", "other"),  # kana: Japanese, though it has a kanji
        ("¿Cuál es la capital de Francia?", "other"),  # Latin script, not English
    ],
)
def test_detect_language(text: str, expected: str) -> None:
    assert detect_language(text) == expected


def test_role_markers_do_not_make_chinese_chat_mixed() -> None:
    conv = "User: 你好\nAssistant: 你好！\nUser: 天气\n"
    assert detect_language(conv) != "zh"  # the raw markers would tip it
    assert tag(conv, 5, 64).language == "zh"
    assert "User" not in strip_role_markers(conv)


# ---------------------------------------------------------------- numerals


@pytest.mark.parametrize(
    "text,value",
    [
        ("一", 1), ("两", 2), ("十", 10), ("十五", 15), ("二十", 20), ("二十五", 25),
        ("一百", 100), ("一百零五", 105), ("一百一十", 110), ("三百二十一", 321),
        ("九百九十九", 999), ("两百", 200), ("一千", 1000), ("一万二千", 12000), ("百", 100),
    ],
)
def test_chinese_numeral_to_int(text: str, value: int) -> None:
    assert chinese_numeral_to_int(text) == value


@pytest.mark.parametrize("bad", ["", "abc", "五个"])
def test_chinese_numeral_rejects_garbage(bad: str) -> None:
    with pytest.raises(ValueError):
        chinese_numeral_to_int(bad)


@pytest.mark.parametrize(
    "text,value",
    [("one", 1), ("twelve", 12), ("twenty-five", 25), ("one hundred and fifty", 150),
     ("three hundred", 300), ("a", 1), ("a single", 1), ("two thousand", 2000)],
)
def test_english_numeral_to_int(text: str, value: int) -> None:
    assert english_numeral_to_int(text) == value


def test_parse_number_dispatches() -> None:
    assert parse_number("1,000") == 1000
    assert parse_number("42") == 42
    assert parse_number("四十二") == 42
    assert parse_number("forty-two") == 42
    with pytest.raises(ValueError):
        parse_number("lots")


# ---------------------------------------------------------------- length constraints


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("不超过50字", (50, "chars")),
        ("请在50字以内回答", (50, "chars")),
        ("50字之内说明", (50, "chars")),
        ("少于50字", (50, "chars")),
        ("最多50个字", (50, "chars")),
        ("控制在50字左右", (50, "chars")),
        ("不超过三句话", (3, "sentences")),
        ("3句话以内", (3, "sentences")),
        ("两句话以内", (2, "sentences")),
        ("不超过一百字", (100, "chars")),
        ("二十字以内", (20, "chars")),
        ("不超过九百九十九字", (999, "chars")),
        ("不超过200个词", (200, "words")),
        ("用一句话概括", (1, "sentences")),
        ("字数不超过300", (300, "chars")),
        ("不超过５０字", (50, "chars")),  # full-width digits
        ("不超过30个token", (30, "tokens")),
        ("Answer in under 50 words", (50, "words")),
        ("at most 50 words", (50, "words")),
        ("no more than 50 words", (50, "words")),
        ("fewer than 50 words", (50, "words")),
        ("within 100 characters", (100, "chars")),
        ("at most 3 sentences", (3, "sentences")),
        ("at most three sentences", (3, "sentences")),
        ("Explain it in one sentence", (1, "sentences")),
        ("max 20 tokens", (20, "tokens")),
        ("Keep it under 30 words", (30, "words")),
        ("Write a 50-word summary", (50, "words")),
        ("100 words or less", (100, "words")),
        ("in under one hundred and fifty words", (150, "words")),
        # numbers in words with an article, ranges (the upper end caps), "keep it to"
        ("Reply in under a thousand words", (1000, "words")),
        ("two dozen words or less", (24, "words")),
        ("Keep your answer to twenty words", (20, "words")),
        ("Describe it in four or five sentences", (5, "sentences")),
        ("in 2-4 sentences", (4, "sentences")),
        ("用两到三句话回答", (3, "sentences")),
        ("把这段话压缩成八十字", (80, "chars")),
        ("一句话说明原因", (1, "sentences")),
        # a cap on each of N items caps the answer at N times it
        ("Name five rivers, each in under 6 words", (30, "words")),
        ("给出四个标题，每个不超过十二个字", (48, "chars")),
    ],
)
def test_parse_length_constraint(prompt: str, expected: tuple[int, str]) -> None:
    assert parse_length_constraint(prompt) == expected


@pytest.mark.parametrize(
    "prompt",
    [
        "不少于50字",  # at least 50: not a limit
        "超过50字的文章",  # more than 50
        "写一篇文章",
        "Write at least 200 words",
        "He is a 5-year-old boy",
        "",
        "每个标题不超过十二个字",  # a cap on each item, and no count of items: no cap on the answer
        "Give some ideas, each under 10 words",
    ],
)
def test_no_length_constraint(prompt: str) -> None:
    assert parse_length_constraint(prompt) == (0, "")
    assert find_length_constraints(prompt) == []


def test_tightest_constraint_wins_by_budget() -> None:
    prompt = "不超过100字，最多三句话"
    assert find_length_constraints(prompt) == [(100, "chars"), (3, "sentences")]
    # 100 chars -> 158 tokens, 3 sentences -> 128 tokens
    assert parse_length_constraint(prompt, tokens_per_char=1.0) == (3, "sentences")
    # 100 chars at 0.5 tokens/char -> 83 tokens, now tighter
    assert parse_length_constraint(prompt, tokens_per_char=0.5) == (100, "chars")
    assert tag(prompt, 5, 1000).output_budget == 128


def test_implied_budget_table() -> None:
    assert set(BUDGET_RULES) == {"chars", "words", "sentences", "tokens"}
    assert implied_budget(50, "chars") == 83
    assert implied_budget(50, "chars", tokens_per_char=0.7) == 61  # ceil(52.5 + 8)
    assert implied_budget(50, "words") == 108
    assert implied_budget(3, "sentences") == 128
    assert implied_budget(20, "tokens") == 20
    assert implied_budget(1, "tokens") == 1
    assert implied_budget(1, "chars", tokens_per_char=0.001) == 9  # rounds up


def test_compute_output_budget() -> None:
    assert compute_output_budget(256, 0, "") == 256
    assert compute_output_budget(256, 20, "tokens") == 20
    assert compute_output_budget(10, 20, "tokens") == 10
    assert compute_output_budget(50, 1000, "words") == 50


@pytest.mark.parametrize("budget,size", [(1, "short"), (64, "short"), (65, "medium"),
                                         (512, "medium"), (513, "long"), (4096, "long")])
def test_classify_size(budget: int, size: str) -> None:
    assert classify_size(budget) == size


def test_size_class_follows_budget() -> None:
    assert tag("Explain it in one sentence", 5, 1024).size_class == "short"  # 48 tokens
    assert tag("Tell me about rivers", 5, 1024).size_class == "long"
    assert tag("Tell me about rivers", 5, 64).size_class == "short"


# ---------------------------------------------------------------- task


@pytest.mark.parametrize(
    "text,task",
    [
        ("把这段话翻译成英文", "translate"),
        ("Translate this Python function into Chinese", "translate"),  # translate beats code
        ("请总结这篇文章", "summarize"),
        ("概括一下下面的内容", "summarize"),
        ("tl;dr of this bug report", "summarize"),  # summarize beats code
        ("Give me a summary of the meeting", "summarize"),
        ("帮我写一个排序函数", "code"),
        ("Why does my python code throw an error?", "code"),
        ("Fix this bug", "code"),
        ("写一首关于春天的诗", "creative"),
        ("Tell me a story about a dragon", "creative"),
        ("Write a poem about the sea", "creative"),
        ("What is the boiling point of water?", "qa"),
        ("天空为什么是蓝色的？", "qa"),
        ("What does 'carpe diem' mean in English?", "translate"),
        ("How do you say good night in Korean?", "translate"),
        ("See you later alligator 是什么意思", "translate"),
        ("Write a riddle about a clock", "creative"),
        ("写一副新年对联", "creative"),
        ("写一个程序员的段子", "creative"),  # a programmer is a person, not code
        ("My pandas groupby drops NaN keys", "code"),
        ("How should I react to criticism?", "qa"),  # react the verb, not React
    ],
)
def test_detect_task(text: str, task: str) -> None:
    assert detect_task(text) == task


def test_multi_turn_is_chat_even_with_keywords() -> None:
    assert detect_task("translate this", turns=2) == "chat"
    assert tag("User: translate hi\nAssistant: 你好\nUser: thanks", 5, 64).task == "chat"


def test_english_keywords_need_word_boundaries() -> None:
    assert count_lexicon_hits("There is an issue", ("sue",)) == 0
    assert count_lexicon_hits("They will sue", ("sue",)) == 1
    assert count_lexicon_hits("Two contracts", ("contract",)) == 1  # plural
    assert detect_task("Which episode was the best?") == "qa"  # no "code" inside "episode"
    assert detect_domain("Use the taxi") == "general"  # "tax" is not in "taxi"


def test_overlapping_keywords_count_once() -> None:
    assert count_lexicon_hits("血糖仪", ("血糖", "血糖仪")) == 1


# ---------------------------------------------------------------- domain and audience


@pytest.mark.parametrize(
    "text,domain",
    [
        ("我的血压有点高，需要吃药吗", "medical"),
        ("How do I use a glucose meter?", "medical"),
        ("这份合同的违约条款是什么意思", "legal"),
        ("Should I hire an attorney for this lawsuit?", "legal"),
        ("现在贷款利率是多少", "finance"),
        ("Should I invest in stocks or pay off my loan?", "finance"),
        ("What's a good name for a cat?", "general"),
        # two legal hits vs one finance hit
        ("The contract clause about the loan", "legal"),
        # one hit each: tie goes to medical, then legal
        ("doctor contract", "medical"),
        ("contract loan", "legal"),
        # everyday vocabulary, not only the professional words
        ("Is a high price-to-earnings ratio a warning sign?", "finance"),
        ("信用卡逾期会影响征信吗", "finance"),
        ("My tenant stopped paying rent and won't leave; can I evict him?", "legal"),
        ("公司不给经济补偿就辞退我，合法吗", "legal"),
        ("Can I take ibuprofen for a toothache?", "medical"),
        ("嗓子疼还有点发烧，要去医院吗", "medical"),
        ("How do I write a function that adds two numbers?", "general"),  # coding, no domain
    ],
)
def test_detect_domain(text: str, domain: str) -> None:
    assert detect_domain(text) == domain


@pytest.mark.parametrize(
    "text,audience",
    [
        ("给奶奶解释一下怎么用微信", "elderly"),
        ("Explain the internet to my elderly grandmother", "elderly"),
        ("我爷爷85岁了", "elderly"),
        ("给小朋友讲讲恐龙", "child"),
        ("Explain gravity to a 5-year-old", "child"),
        ("Explain gravity to a five-year-old", "child"),
        ("一个七岁的学生", "child"),
        ("请为医生总结这篇论文", "expert"),
        ("Summarize this trial for doctors", "expert"),
        ("Write for an expert audience", "expert"),
        ("我要去看医生", "general"),  # seeing a doctor says nothing about the reader
        ("我今年30岁", "general"),
        ("万岁", "general"),
        ("How do magnets work?", "general"),
        # a profession after a reader cue is the reader; a profession only mentioned is not
        ("For tax accountants: what changed in depreciation rules?", "expert"),
        ("I'm a radiologist; compare these two contrast agents", "expert"),
        ("面向会计师讲讲新收入准则", "expert"),
        ("My accountant says I owe more tax", "general"),
        ("因为医生说要多喝水，推荐几种饮料", "general"),  # 因为 + 医生 is not 为医生
        # someone only talked about (a possessive with no reader cue) is not the reader
        ("Who keeps the kids' toys after the move?", "general"),
        ("孩子的学费可以分期交吗", "general"),
        ("给老人的手机推荐", "elderly"),  # 给 makes the 老人 the one it is for
        ("Explain fractions to fourth graders", "child"),
    ],
)
def test_detect_audience(text: str, audience: str) -> None:
    assert detect_audience(text) == audience


# ---------------------------------------------------------------- turns and prefix key


def _conversation(system: str, first: str, second: str) -> str:
    return (
        f"System: {system}\n"
        f"User: {first}\n"
        "Assistant: Sure.\n"
        f"User: {second}\n"
    )


def test_multi_turn_chat_with_system_prompt() -> None:
    a = tag(_conversation("You are a helpful assistant.", "Hi", "Tell me a joke"), 30, 128)
    b = tag(_conversation("You are a helpful assistant.", "Hello", "What is 2+2?"), 30, 128)
    c = tag(_conversation("You are a pirate.", "Hi", "Tell me a joke"), 30, 128)
    assert a.turns == b.turns == c.turns == 2
    assert a.task == "chat"
    assert a.prefix_key != 0
    assert a.prefix_key == b.prefix_key  # same system prompt, same cache key
    assert a.prefix_key != c.prefix_key
    expected = int.from_bytes(
        hashlib.blake2b(b"You are a helpful assistant.", digest_size=8).digest(), "little"
    )
    assert a.prefix_key == expected
    assert 0 < a.prefix_key < 2**64


def test_chinese_role_markers_and_full_width_colon() -> None:
    conv = "系统：你是一名医生。\n用户：我血糖高吗？\n助手：请告诉我读数。\n用户：7.8\n"
    assert count_turns(conv) == 2
    assert extract_system_prompt(conv) == "你是一名医生。"
    t = tag(conv, 30, 128)
    assert t.turns == 2
    assert t.task == "chat"
    assert t.prefix_key == compute_prefix_key("你是一名医生。")
    assert t.language == "zh"


def test_turn_counting() -> None:
    assert count_turns("Just a question") == 1
    assert count_turns("User: one question") == 1
    assert count_turns("Human: a\nAI: b\nHuman: c\nAI: d\nHuman: e") == 3
    assert count_turns("Users: are counted only with the exact marker") == 1
    assert count_turns("He said User: hi inside a line") == 1


def test_system_prompt_forms() -> None:
    assert extract_system_prompt("System: Be brief.\n\nWhat is 2+2?") == "Be brief."
    assert extract_system_prompt("<<SYS>>\nBe kind.\n<</SYS>>\nhello") == "Be kind."
    assert extract_system_prompt("<s>[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\nhi [/INST]") == "Be kind."
    # Text before the first user marker is the system prompt even without "System:".
    assert extract_system_prompt("You are terse.\nUser: hi\nAssistant: yo") == "You are terse."
    # Dialogue before the first user line is not a system prompt.
    assert extract_system_prompt("Assistant: Hello!\nUser: hi") == ""
    assert extract_system_prompt("User: hi\nAssistant: yo") == ""
    assert extract_system_prompt("What is 2+2?") == ""


def test_llama_template_turns_and_key() -> None:
    one = "<s>[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\nhi [/INST] hello </s><s>[INST] more [/INST]"
    two = "<s>[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\nyo [/INST]"
    assert count_turns(one) == 2
    assert tag(one, 10, 64).prefix_key == tag(two, 10, 64).prefix_key != 0


def test_no_system_prompt_gives_zero_key() -> None:
    assert compute_prefix_key("") == 0
    assert tag("What is 2+2?", 5, 16).prefix_key == 0
    assert tag("User: hi\nAssistant: yo\nUser: bye", 5, 16).prefix_key == 0
