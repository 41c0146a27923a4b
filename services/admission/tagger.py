"""Rule-based intent tagger for the admission service.

The admission service has to decide, before a request reaches a pipeline, how big
the answer will be, how important it is, and which earlier requests share its
prefix: the tagger hashes the system prompt into ``prefix_key``, which admission
salts with the tenant and routes by (the ``prefix`` scorer of routing.py sends
it where that prefix went before, so the stages' prefix cache there may hold
its KV). The tagger keeps no cache itself.

Calling a model for that would cost more than it saves, so this module uses
lexicons (lexicons.py) and regular expressions only (Chinese and English), and
is pure: no I/O, no global state beyond compiled patterns. Its accuracy per
dimension is measured on a hand-labelled table of prompts
(tests/services/admission/data/tagger_labels.jsonl, test_tagger_table.py).

Language is read per sentence: code names, identifiers and English terms inside
a Chinese sentence are Chinese text ("用Python写一个函数" is zh), a Chinese term in
an English sentence is English, whole sentences in both are "mixed".

Output budget
-------------
An explicit length constraint in the prompt ("不超过50字", "in under 50 words")
caps the number of tokens we reserve for the answer. The implied budget is
``ceil(limit * tokens_per_unit + overhead)`` with the table ``BUDGET_RULES``:

=========  ===================================  ========
unit       tokens per unit                      overhead
=========  ===================================  ========
chars      1.5 * tokens_per_char                8
words      2.0                                  8
sentences  40.0                                 8
tokens     1.0                                  0
=========  ===================================  ========

The 1.5 slack and the overhead leave room for punctuation and for models that
overshoot a little; ``tokens_per_char`` is the tokenizer's ratio for the
prompt's script. The result is clamped to ``[1, max_tokens]``; without a
constraint the budget is ``max_tokens``. When a prompt holds several
constraints the one with the smallest implied budget wins.

A limit above ``MAX_LENGTH_LIMIT`` (1,000,000) is not a plausible constraint
("under hundred hundred hundred ... words"): it is ignored, like a limit of
zero, so the prompt gets ``max_tokens``. Numbers are also bounded in length
where they are matched (at most 12 digits, 16 Chinese numeral characters or 10
English number words); a longer run is not a number at all, and no match may
start inside one. ``implied_budget`` clamps its own input too, so it cannot
overflow whatever it is given.

Linear time
-----------
Every pattern here runs over untrusted prompt text on the front door, so each
must cost O(1) per start position: no unbounded quantifier is nested in
another or sits next to one that can take the same characters, and runs that
a match could start inside (digits, numerals, number words, whitespace) are
bounded and guarded by lookbehinds. ``tag`` is then linear in the prompt and
raises only ValueError, and only for its documented argument checks.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

# Word lists and number tables: data only, in lexicons.py.
from services.admission import lexicons as lex
from tether.priority import Priority
from tether.priority import parse as parse_priority

__all__ = [
    "Tags",
    "tag",
    "tag_conversation",
    "BUDGET_RULES",
    "MAX_LENGTH_LIMIT",
    "detect_language",
    "chinese_numeral_to_int",
    "english_numeral_to_int",
    "parse_number",
    "find_length_constraints",
    "parse_length_constraint",
    "implied_budget",
    "compute_output_budget",
    "classify_size",
    "count_lexicon_hits",
    "strip_role_markers",
    "count_turns",
    "extract_system_prompt",
    "compute_prefix_key",
    "detect_task",
    "detect_domain",
    "detect_audience",
]


@dataclass(frozen=True)
class Tags:
    input_tokens: int
    language: str  # "zh" | "en" | "mixed" | "other"
    length_limit: int  # explicit limit found in the prompt, 0 when none
    length_unit: str  # "chars" | "words" | "sentences" | "tokens" | "" when none
    output_budget: int  # max_tokens after applying the length constraint
    task: str  # "qa" | "summarize" | "translate" | "code" | "creative" | "chat"
    size_class: str  # "short" | "medium" | "long"
    domain: str  # "general" | "medical" | "legal" | "finance"
    audience: str  # "general" | "elderly" | "child" | "expert"
    priority: Priority
    tenant: str
    turns: int  # conversation turns detected (1 for a single prompt)
    prefix_key: int  # 64-bit hash of the shared system prompt (0 when none)


# --------------------------------------------------------------------------
# Tables and lexicons
# --------------------------------------------------------------------------

# unit -> (tokens per unit, overhead); "chars" is further scaled by tokens_per_char.
BUDGET_RULES: dict[str, tuple[float, int]] = {
    "chars": (1.5, 8),
    "words": (2.0, 8),
    "sentences": (40.0, 8),
    "tokens": (1.0, 0),
}
# A parsed limit above this is ignored: no real prompt asks for a million words,
# and a bigger number would only overflow the float arithmetic of implied_budget.
MAX_LENGTH_LIMIT = 1_000_000
# implied_budget never returns more than this (the largest int64 a proto field holds).
_MAX_BUDGET = 2**63 - 1

# size_class thresholds on output_budget (inclusive upper bounds).
SHORT_MAX_TOKENS = 64
MEDIUM_MAX_TOKENS = 512

# Share of the (Chinese + English) units one language needs to name the prompt's language.
DOMINANT_SHARE = 0.7

# An age mentioned in the prompt ("5-year-old", "80岁") also names the reader.
CHILD_MAX_AGE = 12
ELDERLY_MIN_AGE = 65
MAX_HUMAN_AGE = 130  # "万岁" (long live!) parses as 10000 and is not an age




# --------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------



def chinese_numeral_to_int(text: str) -> int:
    """Convert a Chinese numeral ("二十", "一百零五", "两千") to an int.

    A unit with no digit before it counts one of that unit ("十五" is 15,
    "百字" is 100). Raises ValueError on anything that is not a numeral.
    """
    if not text:
        raise ValueError("empty Chinese numeral")
    total = 0  # completed 万/亿 groups
    section = 0  # value below the current 万/亿 group
    digit = 0  # pending digit waiting for its unit
    for ch in text:
        if ch in lex.CN_DIGITS:
            digit = lex.CN_DIGITS[ch]
        elif ch in lex.CN_SMALL_UNITS:
            section += (digit or 1) * lex.CN_SMALL_UNITS[ch]
            digit = 0
        elif ch in lex.CN_BIG_UNITS:
            total += (section + digit or 1) * lex.CN_BIG_UNITS[ch]
            section = digit = 0
        else:
            raise ValueError(f"not a Chinese numeral: {text!r}")
    return total + section + digit


def english_numeral_to_int(text: str) -> int:
    """Convert English number words ("twenty-five", "one hundred and fifty") to an int.

    "a", "an", "single" and "a single" count as one, and "a"/"an" before a scale is one
    of it ("a dozen", "a hundred"). Raises ValueError otherwise.
    """
    cleaned = " ".join(text.lower().replace("-", " ").split())
    if cleaned in lex.EN_ONE_ARTICLES:
        return 1
    if not cleaned:
        raise ValueError("empty English numeral")
    total = 0
    current = 0
    words = cleaned.split(" ")
    if len(words) > 1 and words[0] in ("a", "an") and words[1] in lex.EN_SCALES:
        words = words[1:]
    for word in words:
        if word == "and":
            continue
        if word in lex.EN_ONES:
            current += lex.EN_ONES[word]
        elif word in lex.EN_TENS:
            current += lex.EN_TENS[word]
        elif word == "dozen":
            current = (current or 1) * 12
        elif word == "hundred":
            current = (current or 1) * 100
        elif word == "thousand":
            total += (current or 1) * 1000
            current = 0
        else:
            raise ValueError(f"not an English numeral: {text!r}")
    return total + current


def parse_number(text: str) -> int:
    """Parse an Arabic ("1,000"), Chinese ("三十") or English ("thirty") number."""
    stripped = text.strip()
    digits = stripped.replace(",", "")
    if digits.isascii() and digits.isdigit():
        return int(digits)
    if stripped and all(ch in lex.CN_NUMERAL_CHARS for ch in stripped):
        return chinese_numeral_to_int(stripped)
    return english_numeral_to_int(stripped)


# --------------------------------------------------------------------------
# Lexicon matching
# --------------------------------------------------------------------------


def _trie_regex(words: set[str], suffix: Callable[[str], str]) -> str:
    """One regex for a set of literal words, factored by common prefix (a trie).

    A flat alternation tries every word at every position; the trie follows only
    the branches the text takes, so a 300-word lexicon costs about as much as one
    word. At a node where one word ends and a longer one goes on, the longer is
    tried first, so "血糖仪" counts once, not as "血糖" too. suffix(word) is what may
    follow a complete word (a plural "s").
    """
    trie: dict[str, dict] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # "" marks the end of a word
    def build(node: dict[str, dict], prefix: str) -> str:
        branches = [re.escape(ch) + build(child, prefix + ch) for ch, child in sorted(node.items()) if ch]
        if "" not in node:
            return branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{'|'.join([*branches, suffix(prefix)])})" if branches else suffix(prefix)
    return build(trie, "")


@lru_cache(maxsize=64)
def _lexicon_pattern(lexicon: tuple[str, ...]) -> re.Pattern[str]:
    """One trie-shaped regex per lexicon (see _trie_regex).

    Matched against lowercased text: re.IGNORECASE, and a boundary check per word
    instead of one shared check, each cost several times more at every position.
    """
    words = {w.lower() for w in lexicon if w}
    parts = []
    # Chinese has no word boundaries to check. These go first: a non-ASCII word can
    # only clash with an ASCII word that is its (shorter) prefix, so longest-first holds.
    chinese = {w for w in words if not w.isascii()}
    if chinese:
        parts.append(_trie_regex(chinese, lambda w: ""))
    # English words need boundaries ("sue" must not hit "issue"); allow plurals.
    english = {w for w in words if w.isascii()}
    if english:
        plural = _trie_regex(english, lambda w: "(?:s|es)?" if w[-1].isalpha() else "")
        parts.append(rf"(?<![a-z0-9]){plural}(?![a-z0-9])")
    return re.compile("|".join(parts))


def count_lexicon_hits(text: str, lexicon: tuple[str, ...]) -> int:
    """Number of non-overlapping lexicon hits in text (case-insensitive)."""
    if not any(lexicon):
        return 0
    return len(_lexicon_pattern(lexicon).findall(text.lower()))


def _label_hits(text: str, label: str, lexicon: tuple[str, ...]) -> int:
    """Lexicon hits for label, less those inside its false friends ("程序" in "程序员")."""
    return count_lexicon_hits(text, lexicon) - count_lexicon_hits(text, lex.FALSE_FRIENDS.get(label, ()))


def _best_by_hits(
    text: str, lexicons: tuple[tuple[str, tuple[str, ...]], ...], extra: dict[str, int] | None = None
) -> str:
    """Label with the most hits; ties go to the earlier lexicon; "" when nothing hits."""
    best_label, best_hits = "", 0
    for label, lexicon in lexicons:
        hits = _label_hits(text, label, lexicon) + (extra or {}).get(label, 0)
        if hits > best_hits:  # strict: an equal count keeps the earlier label
            best_label, best_hits = label, hits
    return best_label


# --------------------------------------------------------------------------
# Language
# --------------------------------------------------------------------------


# What one Latin-script word weighs against one Chinese character: a Chinese word averages about
# 1.7 characters, so a sentence holds about as many units in either script.
LATIN_WORD_WEIGHT = 1.7
# Share of "other" (kana, Hangul, Cyrillic, non-English Latin) units that makes the prompt "other".
OTHER_SHARE = 0.5

_CJK_RANGES = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"
_KANA_RANGES = "\u3040-\u30ff"
_HANGUL_RANGES = "\u1100-\u11ff\u3130-\u318f\uac00-\ud7af"
_LATIN_RANGES = "A-Za-z\u00c0-\u024f"
# One token per match; every branch is a single character class (or a fixed tail), so the scan is
# linear. Segments end at sentence ends and at colons: "翻译成中文：<English text>" is two segments.
_LANG_TOKEN = re.compile(
    rf"(?P<cjk>[{_CJK_RANGES}])"
    rf"|(?P<kana>[{_KANA_RANGES}])"
    rf"|(?P<hangul>[{_HANGUL_RANGES}])"
    rf"|(?P<latin>[{_LATIN_RANGES}]+(?:['’][{_LATIN_RANGES}]{{1,3}})?)"
    rf"|(?P<alpha>[^\W\d_{_LATIN_RANGES}{_CJK_RANGES}{_KANA_RANGES}{_HANGUL_RANGES}]+)"
    r"|(?P<code>[(){}\[\]=<>+*/\\`#$|&^~]+)"
    r"|(?P<end>[。！？!?；\n：:]|[.;](?=\s|\Z))"  # NFKC has made "：" a ":"
)



class _Segment:
    """Counts for one sentence-like segment of the prompt."""

    __slots__ = ("cjk", "kana", "hangul", "latin", "alpha", "code", "zh_grammar")

    def __init__(self) -> None:
        self.cjk = self.kana = self.hangul = self.latin = self.alpha = self.code = 0
        self.zh_grammar = False


def _language_units(text: str) -> tuple[float, float, float]:
    """(zh, en, other) units of the prompt, segment by segment.

    In a segment that has both Chinese characters and Latin words, the matrix language takes both:
    Chinese when the segment has Chinese grammar or more characters than words ("用Python写一个函数",
    "Java里的HashMap"), else English ("Explain 机器学习 in simple terms"). A Latin-only segment that
    looks like code (brackets, operators) counts for nothing once the prompt holds Chinese.
    """
    zh = en = other = code_latin = 0.0
    english_words = foreign_words = 0
    seg = _Segment()

    def close(seg: _Segment) -> tuple[float, float, float, float]:
        o: float
        if seg.kana and seg.kana * 4 >= seg.cjk + seg.kana:  # kanji among kana: Japanese
            o = seg.cjk + seg.kana
            seg.cjk = seg.kana = 0
        else:
            o = seg.kana
        o += seg.hangul + seg.alpha * LATIN_WORD_WEIGHT
        words = seg.latin * LATIN_WORD_WEIGHT
        if seg.cjk and seg.latin:
            if seg.zh_grammar or seg.cjk >= seg.latin:
                return seg.cjk + words, 0.0, o, 0.0
            return 0.0, seg.cjk + words, o, 0.0
        if seg.latin and seg.code:
            return 0.0, 0.0, o, words
        return float(seg.cjk), words, o, 0.0

    for m in _LANG_TOKEN.finditer(text):
        kind = m.lastgroup
        if kind == "cjk":
            seg.cjk += 1
            seg.zh_grammar = seg.zh_grammar or m.group() in lex.ZH_FUNCTION_CHARS
        elif kind == "latin":
            seg.latin += 1
            word = m.group().lower()
            english_words += word in lex.ENGLISH_FUNCTION_WORDS
            foreign_words += word in lex.FOREIGN_FUNCTION_WORDS
        elif kind == "end":
            z, e, o, c = close(seg)
            zh, en, other, code_latin = zh + z, en + e, other + o, code_latin + c
            seg = _Segment()
        elif kind is not None:   # every alternative of _LANG_TOKEN is a named group
            setattr(seg, kind, getattr(seg, kind) + 1)
    z, e, o, c = close(seg)
    zh, en, other, code_latin = zh + z, en + e, other + o, code_latin + c
    if not zh:  # no Chinese for code to sit inside: brackets do not make English prose code
        en += code_latin
    # Spanish, French, German...: Latin script, not English.
    if foreign_words >= 2 and foreign_words > english_words:
        en, other = 0.0, other + en
    return zh, en, other


def detect_language(text: str) -> str:
    """"zh", "en", "mixed" or "other": which language the prompt is written in.

    Counts Chinese characters against Latin words (LATIN_WORD_WEIGHT each) per segment, with
    identifiers, code names and product names inside a Chinese sentence counted as Chinese text
    (see _language_units). Kana, Hangul, other scripts and non-English Latin-script prose are
    "other"; digits and punctuation count for nothing.
    """
    normalized = unicodedata.normalize("NFKC", text)  # full-width ＡＢＣ count as Latin
    zh, en, other = _language_units(normalized)
    total = zh + en + other
    if total == 0:
        return "other"
    if other / total >= OTHER_SHARE or zh + en == 0:
        return "other"
    if zh / (zh + en) >= DOMINANT_SHARE:
        return "zh"
    if en / (zh + en) >= DOMINANT_SHARE:
        return "en"
    return "mixed"


# --------------------------------------------------------------------------
# Length constraints and budget
# --------------------------------------------------------------------------



# Linear time (see the module docstring): each quantifier below is bounded, and
# lookbehinds/lookaheads stop a number from starting or ending inside a longer
# run, so a run too long to be a number is rejected in O(1) at each position
# instead of being rescanned from every position inside it.
_GAP = r"\s{0,4}"  # optional whitespace between tokens
_SEP = r"\s{1,4}"  # required whitespace between tokens
_MAX_DIGITS = 12
_MAX_CN_NUMERAL_CHARS = 16  # 一千二百三十四万五千六百七十八 has 15
_MAX_EN_NUMBER_WORDS = 10  # nine hundred ninety-nine thousand nine hundred ninety-nine has 9

_CN_NUM = (
    rf"((?<![0-9])[0-9]{{1,{_MAX_DIGITS}}}(?![0-9])"
    rf"|(?<![{lex.CN_NUMERAL_CHARS}])[{lex.CN_NUMERAL_CHARS}]{{1,{_MAX_CN_NUMERAL_CHARS}}}(?![{lex.CN_NUMERAL_CHARS}]))"
)
_CN_UNIT = r"(?:个)?(字符|字|单词|词|句话|句子|句|tokens?)"
# "少于" etc. must not follow 不: "不少于50字" means at least 50.
_CN_PREFIX = (
    r"(?:不超过|不超出|不多于|不大于|不得超过|不能超过|不要超过|别超过|"
    r"(?<!不)少于|(?<!不)低于|(?<!不)小于|最多|至多|"
    r"控制在|限制在|限定在|限于|限在|限)"
)
_EN_NUMBER_WORDS = "|".join(
    sorted([*lex.EN_ONES, *lex.EN_TENS, *lex.EN_SCALES], key=len, reverse=True)
)
_EN_WORD = rf"\b(?:{_EN_NUMBER_WORDS})\b"
_EN_WORD_GAP = r"[\s-]{1,4}"  # "twenty-five", "one hundred", "twenty - five"
# [0-9], not \d: \d also takes other scripts' digits, which parse_number rejects.
# "1,000,000" groups; a digit or "digit," just before means we are inside a run.
_EN_DIGITS = (
    rf"(?<![0-9])(?<![0-9],)(?:[0-9]{{1,3}}(?:,[0-9]{{3}}){{1,3}}|[0-9]{{1,{_MAX_DIGITS}}})(?![0-9])"
)
# Python's lookbehind is fixed-width, so "not inside a run of number words" is
# checked after the match, by _continues_number_words. The group is atomic: what
# follows a number (a unit, "years") is never a number word, so giving words back
# cannot make a match, and not trying saves the backtracking on every failed start.
_EN_WORDS = (
    rf"(?>(?:\ban?{_EN_WORD_GAP}(?=(?:{'|'.join(lex.EN_SCALES)})\b))?"  # "a dozen", "a hundred"
    rf"{_EN_WORD}(?:{_EN_WORD_GAP}(?:and{_EN_WORD_GAP})?{_EN_WORD}){{0,{_MAX_EN_NUMBER_WORDS - 1}}})"
)
_EN_NUM_ALTERNATIVES = rf"{_EN_DIGITS}|{_EN_WORDS}"
_EN_NUM = rf"({_EN_NUM_ALTERNATIVES})"
# "two or three sentences", "2-3 sentences": the range's upper end is the cap, so the lower is skipped.
_EN_RANGE_LEAD = (
    rf"(?:(?:{_EN_NUM_ALTERNATIVES}){_SEP}(?:or|to){_SEP}|[0-9]{{1,{_MAX_DIGITS}}}\s{{0,2}}[-–]\s{{0,2}})?"
)
_CN_RANGE_LEAD = rf"(?:[0-9{lex.CN_NUMERAL_CHARS}]{{1,4}}{_GAP}(?:到|至|或|-|~|～){_GAP})?"  # 三到五句话
_EN_UNIT = r"(words?|characters?|chars?|letters?|sentences?|tokens?)\b"
_EN_PREFIX = (
    rf"(?:under|below|fewer{_SEP}than|less{_SEP}than|no{_SEP}more{_SEP}than|not{_SEP}more{_SEP}than|"
    rf"no{_SEP}longer{_SEP}than|not{_SEP}exceeding|not{_SEP}to{_SEP}exceed|at{_SEP}most|within|up{_SEP}to|"
    rf"max(?:imum)?\.?(?:{_SEP}of)?|limit(?:ed)?{_SEP}(?:to|of)|capped{_SEP}at|"
    rf"(?:keep|limit){_SEP}(?:it|this|that|(?:your|the){_SEP}(?:answer|response|reply|summary)){_SEP}(?:to|at))"
)

# Each pattern has exactly two groups: (number, unit).
_CONSTRAINT_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(p, re.IGNORECASE)
    for p in (
        # 不超过50字 / 最多50个字 / 控制在50字 / 不超过三句话 / 不超过200个词
        rf"{_CN_PREFIX}{_GAP}(?:用{_GAP})?{_CN_RANGE_LEAD}{_CN_NUM}{_GAP}{_CN_UNIT}",
        # 50字以内 / 50字之内 / 3句话以内 / 100字以下
        rf"{_CN_NUM}{_GAP}{_CN_UNIT}{_GAP}(?:以内|之内|以下|内(?!容))",
        # 用一句话概括 / 用100字介绍
        rf"用{_GAP}{_CN_RANGE_LEAD}{_CN_NUM}{_GAP}{_CN_UNIT}",
        # 概括成三句话 / 压缩成五十字
        rf"(?:概括|总结|归纳|浓缩|压缩|缩写|精简|改写|写|说|讲){_GAP}成{_GAP}{_CN_NUM}{_GAP}{_CN_UNIT}",
        # 一句话概括 / 两句话说明
        rf"{_CN_NUM}{_GAP}(句话|句)(?={_GAP}(?:概括|总结|归纳|说明|解释|介绍|讲清|说清|回答|描述))",
        # at most 50 words / in under 50 words / within 100 characters / max 20 tokens
        rf"\b{_EN_PREFIX}{_SEP}{_EN_RANGE_LEAD}{_EN_NUM}{_SEP}{_EN_UNIT}",
        # in one sentence / in a single word / in 3 sentences
        rf"\bin{_SEP}{_EN_RANGE_LEAD}(a{_SEP}single|an?|single|{_EN_NUM_ALTERNATIVES}){_SEP}{_EN_UNIT}",
        # 50 words or less / 20 tokens max
        rf"{_EN_NUM}{_SEP}{_EN_UNIT}{_SEP}(?:or{_SEP}(?:less|fewer|under)|max(?:imum)?|at{_SEP}most|tops)\b",
        # a 50-word summary / a one-sentence answer
        rf"{_EN_NUM}-(word|character|char|sentence|token)\b",
    )
)
# 字数不超过50 / 字数在50以内: the unit comes before the number.
_CN_CHAR_COUNT_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(rf"字数{_GAP}{_CN_PREFIX}{_GAP}{_CN_NUM}"),
    re.compile(rf"字数{_GAP}在{_GAP}{_CN_NUM}{_GAP}(?:个?字{_GAP})?(?:以内|之内|以下)"),
)

# What a number phrase continuing a run of number words has just left of it.
_EN_RUN_TAIL = re.compile(
    rf"\b(?:{_EN_NUMBER_WORDS}){_EN_WORD_GAP}(?:and{_EN_WORD_GAP})?\Z", re.IGNORECASE
)
_EN_RUN_LOOKBACK = 24  # longest word (9) + gap (4) + "and" (3) + gap (4), and a little room


def _continues_number_words(text: str, start: int) -> bool:
    """True when the English number phrase at start is only the tail of a longer run.

    The bounded pattern would otherwise take the last words of "hundred hundred
    ... hundred words" as a number. Digits and Chinese numerals need no such
    check: their lookbehinds are fixed-width.
    """
    first = text[start:start + 1]
    if not (first.isascii() and first.isalpha()):
        return False
    # pos/endpos instead of a slice: \b at pos still sees the character before it.
    return _EN_RUN_TAIL.search(text, max(0, start - _EN_RUN_LOOKBACK), start) is not None


def _matched_number(text: str, m: re.Match[str]) -> int | None:
    """The number in group 1 of a match; None when it is the tail of a run or does not parse."""
    if _continues_number_words(text, m.start(1)):
        return None
    try:
        return parse_number(m.group(1))
    except ValueError:  # IGNORECASE lets a few non-ASCII look-alikes ("ſix") past the regex
        return None


# "each under ten words", "每条不超过二十字": a cap on each item of the answer, not on the answer.
_PER_ITEM_BEFORE = re.compile(
    r"(?:\beach(?:\s{1,4}in)?|\bper\s{1,4}[a-z]{1,12}|每一?[条个句点项段首行种步][\u4e00-\u9fff]{0,4})"
    r"\s{0,4}(?:都\s{0,4})?(?:要\s{0,4})?\Z",
    re.IGNORECASE,
)
_PER_ITEM_AFTER = re.compile(r"\s{0,4}(?:each|apiece)\b", re.IGNORECASE)
_PER_ITEM_LOOKBACK = 24
# The number of items, just before the per-item cap: "four tips", "3 reasons", "三条建议".
_ITEM_COUNT = re.compile(
    rf"(?<![a-z0-9])({_EN_NUM_ALTERNATIVES}){_SEP}"
    r"(?!(?:words?|characters?|chars?|letters?|sentences?|tokens?|or|and|to|of)\b)[a-z]"
    rf"|{_CN_NUM}{_GAP}[条个点项句段首种步]",
    re.IGNORECASE,
)
_ITEM_COUNT_LOOKBACK = 64
MAX_ITEMS = 100


def _per_item_count(text: str, m: re.Match[str]) -> int | None:
    """For a per-item cap, the number of items (0 when not stated); None for a cap on the whole answer.

    Looks only a bounded distance around the match, so it stays O(1) per constraint.
    """
    marker = _PER_ITEM_BEFORE.search(text, max(0, m.start() - _PER_ITEM_LOOKBACK), m.start())
    if marker is None and _PER_ITEM_AFTER.match(text, m.end()) is None:
        return None
    end = marker.start() if marker else m.start()
    count = 0
    for c in _ITEM_COUNT.finditer(text, max(0, end - _ITEM_COUNT_LOOKBACK), end):
        raw = c.group(1) or c.group(2)
        try:
            value = parse_number(raw)
        except ValueError:
            continue
        count = value if 0 < value <= MAX_ITEMS else 0
    return count


def _normalize_unit(raw: str) -> str:
    """BUDGET_RULES unit for a matched unit word; "" if unknown (a case-folded look-alike)."""
    unit = raw.lower()
    if unit in lex.UNIT_ALIASES:
        return lex.UNIT_ALIASES[unit]
    return lex.UNIT_ALIASES.get(unit.removesuffix("s"), "")  # English plurals


def find_length_constraints(prompt: str) -> list[tuple[int, str]]:
    """Every explicit length constraint in the prompt as (limit, unit), in text order.

    A cap on each of N items ("four tips, each under ten words") caps the answer at N times it;
    a per-item cap with no count of items caps nothing.

    Limits of zero are dropped: they carry no usable budget. So are limits above
    MAX_LENGTH_LIMIT: no prompt means them, and they would overflow the budget maths.
    """
    text = unicodedata.normalize("NFKC", prompt)  # ５０字 -> 50字
    found: list[tuple[int, int, str]] = []  # (position, limit, unit)
    matches = [(m, m.group(2)) for pattern in _CONSTRAINT_PATTERNS for m in pattern.finditer(text)]
    matches += [(m, "字") for pattern in _CN_CHAR_COUNT_PATTERNS for m in pattern.finditer(text)]
    for m, raw_unit in matches:
        limit = _matched_number(text, m)
        unit = _normalize_unit(raw_unit)
        items = _per_item_count(text, m)
        if items is not None and limit is not None:
            # N items of at most M each cap the answer at N*M; with no N they do not cap it at all.
            limit = limit * items
        if limit is not None and 0 < limit <= MAX_LENGTH_LIMIT and unit:
            found.append((m.start(), limit, unit))
    found.sort(key=lambda item: item[0])
    result: list[tuple[int, str]] = []
    seen: set[tuple[int, str]] = set()  # a set: a prompt may hold thousands of constraints
    for _, limit, unit in found:
        if (limit, unit) not in seen:
            seen.add((limit, unit))
            result.append((limit, unit))
    return result


def implied_budget(limit: int, unit: str, tokens_per_char: float = 1.0) -> int:
    """Tokens a (limit, unit) constraint needs, per BUDGET_RULES; at least 1.

    Not clamped to max_tokens; but the limit is clamped to MAX_LENGTH_LIMIT and
    the result to 2**63 - 1, so no input can overflow the float arithmetic.
    """
    per_unit, overhead = BUDGET_RULES[unit]
    if unit == "chars":
        per_unit *= tokens_per_char
    # round() first so float noise (52.50000000001) does not add a whole token.
    raw = round(min(limit, MAX_LENGTH_LIMIT) * per_unit + overhead, 6)
    if not raw < _MAX_BUDGET:  # also inf and nan, from an absurd tokens_per_char
        return _MAX_BUDGET
    return max(1, math.ceil(raw))


def parse_length_constraint(prompt: str, tokens_per_char: float = 1.0) -> tuple[int, str]:
    """The tightest constraint (smallest implied budget; earliest on ties), or (0, "")."""
    constraints = find_length_constraints(prompt)
    if not constraints:
        return 0, ""
    return min(constraints, key=lambda c: implied_budget(c[0], c[1], tokens_per_char))


def compute_output_budget(max_tokens: int, limit: int, unit: str, tokens_per_char: float = 1.0) -> int:
    """max_tokens capped by the constraint; max_tokens itself when there is none."""
    if limit <= 0 or not unit:
        return max_tokens
    return min(max_tokens, implied_budget(limit, unit, tokens_per_char))


def classify_size(output_budget: int) -> str:
    if output_budget <= SHORT_MAX_TOKENS:
        return "short"
    if output_budget <= MEDIUM_MAX_TOKENS:
        return "medium"
    return "long"


# --------------------------------------------------------------------------
# Conversation structure: turns and shared system prompt
# --------------------------------------------------------------------------


def _role_line_pattern(roles: tuple[str, ...]) -> re.Pattern[str]:
    alternation = "|".join(re.escape(r) for r in roles)
    # (?![a-z]) keeps "AIM:" or "Users:" from counting as a role marker.
    return re.compile(rf"^[ \t]*(?:{alternation})(?![a-z])[ \t]*[:：]", re.IGNORECASE | re.MULTILINE)


_USER_LINE = _role_line_pattern(lex.USER_ROLES)
_ASSISTANT_LINE = _role_line_pattern(lex.ASSISTANT_ROLES)
_SYSTEM_LINE = _role_line_pattern(lex.SYSTEM_ROLES)
_ANY_ROLE_LINE = _role_line_pattern(lex.USER_ROLES + lex.ASSISTANT_ROLES + lex.SYSTEM_ROLES)
# Llama-2 chat template: each [INST] opens a user turn.
_INST_TAG = re.compile(r"\[INST\]")
_SYS_BLOCK = re.compile(r"^\s*(?:<s>\s*)?(?:\[INST\]\s*)?<<SYS>>(.*?)<</SYS>>", re.DOTALL)
_TEMPLATE_TOKENS = re.compile(r"<</?SYS>>|\[/?INST\]|</?s>")


def strip_role_markers(prompt: str) -> str:
    """The prompt without role markers and chat-template tags.

    Used before content detection so "User:"/"Assistant:" in a Chinese chat do
    not count as English letters.
    """
    return _TEMPLATE_TOKENS.sub(" ", _ANY_ROLE_LINE.sub("", prompt))


def count_turns(prompt: str) -> int:
    """Number of user turns (user-role lines or [INST] tags), at least 1."""
    return max(1, len(_USER_LINE.findall(prompt)), len(_INST_TAG.findall(prompt)))


def _strip_system_marker(text: str) -> str:
    m = _SYSTEM_LINE.match(text)
    return (text[m.end():] if m else text).strip()


def extract_system_prompt(prompt: str) -> str:
    """The shared system prompt at the start of the prompt, "" when there is none.

    Recognised forms, in order:
    1. a leading ``<<SYS>> ... <</SYS>>`` block (optionally after ``<s>[INST]``);
    2. when user-role lines exist: everything before the first one, unless that
       preamble opens with an assistant line (then it is dialogue, not a system prompt);
    3. otherwise a first paragraph that starts with "System:" / "系统：".
    A leading "System:" marker is not part of the returned text.
    """
    block = _SYS_BLOCK.match(prompt)
    if block:
        return block.group(1).strip()

    first_user = _USER_LINE.search(prompt)
    if first_user:
        preamble = prompt[: first_user.start()].strip()
        if not preamble or _ASSISTANT_LINE.match(preamble):
            return ""
        return _strip_system_marker(preamble)

    stripped = prompt.lstrip()
    if _SYSTEM_LINE.match(stripped):
        paragraph = re.split(r"\n[ \t]*\n", stripped, maxsplit=1)[0]
        return _strip_system_marker(paragraph)
    return ""


def compute_prefix_key(system_text: str) -> int:
    """64-bit routing key of a shared prefix: blake2b-64 of the system prompt, 0 when empty (not a cache key:
    the stages' prefix cache is keyed by the context hash chain, docs/PROTOCOL.md "Prefix cache")."""
    if not system_text:
        return 0
    # surrogatepass: a lone surrogate in a str must not make tagging raise.
    digest = hashlib.blake2b(system_text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# --------------------------------------------------------------------------
# Task, domain, audience
# --------------------------------------------------------------------------



# "render this paragraph in Spanish", "what does 'carpe diem' mean in English": a verb, then "in <language>" in the same
# sentence. Bounded gap: O(1) per start.
_TRANSLATE_PHRASE = re.compile(
    rf"\b(?:render|say|express|mean)\b[^\n.?!:]{{0,60}}?\b(?:in|into)\s{{1,4}}(?:{lex.LANGUAGE_NAMES})\b", re.IGNORECASE
)
# "<an English phrase> 是什么意思": asking what a foreign sentence means is a translation.
_MEANING_QUESTION = re.compile(r"是?(?:什么|啥)意思")
_LATIN_PHRASE_TAIL = re.compile(r"(?:[A-Za-z']{1,20}\s{1,4}){2,8}[A-Za-z']{1,20}[\"'”’」]?\s{0,4}\Z")
_MEANING_LOOKBACK = 120


def _asks_translation(text: str) -> bool:
    if _TRANSLATE_PHRASE.search(text):
        return True
    for m in _MEANING_QUESTION.finditer(text):
        if _LATIN_PHRASE_TAIL.search(text, max(0, m.start() - _MEANING_LOOKBACK), m.start()):
            return True
    return False


def detect_task(text: str, turns: int = 1) -> str:
    """Multi-turn prompts are "chat"; else the first task lexicon that hits; default "qa"."""
    if turns > 1:
        return "chat"
    for task, lexicon in lex.TASK_LEXICONS:
        if _label_hits(text, task, lexicon) > 0 or (task == "translate" and _asks_translation(text)):
            return task
    return "qa"


def detect_domain(text: str) -> str:
    """Domain with the most lexicon hits (ties: medical, legal, finance); default "general"."""
    return _best_by_hits(text, lex.DOMAIN_LEXICONS) or "general"


_EN_AGE = re.compile(rf"{_EN_NUM}{_EN_WORD_GAP}years?{_EN_WORD_GAP}old\b", re.IGNORECASE)
_CN_AGE = re.compile(rf"{_CN_NUM}{_GAP}岁")


def _age_hits(text: str) -> dict[str, int]:
    """Count ages that name a child (<= 12) or an elderly reader (>= 65)."""
    hits = {"child": 0, "elderly": 0}
    for pattern in (_EN_AGE, _CN_AGE):
        for m in pattern.finditer(text):
            age = _matched_number(text, m)
            if age is None:
                continue
            if age <= CHILD_MAX_AGE:
                hits["child"] += 1
            elif ELDERLY_MIN_AGE <= age <= MAX_HUMAN_AGE:
                hits["elderly"] += 1
    return hits


# A profession after a reader cue names the reader: "for portfolio managers", "as a senior engineer",
# "I'm a nurse", "面向心内科医生", "我是一名药剂师". Bare "my cardiologist" is only someone mentioned.
_EXPERT_READER_EN = re.compile(
    r"\b(?:for|as\s{1,4}an?|i'?m\s{1,4}an?|i\s{1,4}am\s{1,4}an?|aimed\s{1,4}at)\s{1,4}"
    r"(?:[a-z-]{1,20}\s{1,4}){0,4}?"
    rf"(?:{'|'.join(re.escape(w) for w in sorted(lex.EXPERT_READERS_EN, key=len, reverse=True))}|[a-z]{{2,16}}ologist)"
    r"(?:s|es)?\b",
    re.IGNORECASE,
)
_EXPERT_READER_ZH = re.compile(
    r"(?:面向|(?<!因)为(?!什么|了|何)|给|供|我是|作为|身为)(?:一名|一位|一个|名|位)?[\u4e00-\u9fff]{0,5}?"
    rf"(?:{'|'.join(sorted(lex.EXPERT_READERS_ZH, key=len, reverse=True))})"
)
# Someone only talked about, not the reader: "孩子的抚养权", "custody of the kids" (unless a reader cue
# such as 给/向/to/for comes just before: "给三年级的学生讲讲", "for my grandmother's 90th").
_SUBJECT_BEFORE = re.compile(r"\bof\s{1,4}(?:the|my|our|your|his|her|their)\s{1,4}\Z")
_SUBJECT_AFTER = re.compile(r"的|['’](?:s\b|(?=\s))")  # 孩子的, grandma's, the kids'
_READER_CUE = re.compile(r"(?:[给向跟对为教帮][^，。,.!?！？]{0,4}|\b(?:to|for)\b[^,.;!?]{0,12})\Z")
_AUDIENCE_LOOKBACK = 16


def _audience_word_hits(lowered: str, lexicon: tuple[str, ...]) -> int:
    """Lexicon hits that can be the reader: a possessive mention with no reader cue is not counted."""
    hits = 0
    for m in _lexicon_pattern(lexicon).finditer(lowered):
        start = max(0, m.start() - _AUDIENCE_LOOKBACK)
        subject = _SUBJECT_AFTER.match(lowered, m.end()) or _SUBJECT_BEFORE.search(lowered, start, m.start())
        if subject and not _READER_CUE.search(lowered, start, m.start()):
            continue
        hits += 1
    return hits


def detect_audience(text: str) -> str:
    """Audience with the most hits (ties: elderly, child, expert); default "general".

    Hits are audience words that can be the reader, ages ("5-year-old", "80岁") and professions
    after a reader cue.
    """
    lowered = text.lower()
    hits = _age_hits(text)
    hits["expert"] = len(_EXPERT_READER_EN.findall(lowered)) + len(_EXPERT_READER_ZH.findall(lowered))
    best_label, best_hits = "", 0
    for label, lexicon in lex.AUDIENCE_LEXICONS:
        count = (_audience_word_hits(lowered, lexicon) + hits.get(label, 0)
                 - count_lexicon_hits(lowered, lex.FALSE_FRIENDS.get(label, ())))
        if count > best_hits:  # strict: an equal count keeps the earlier label
            best_label, best_hits = label, count
    return best_label or "general"


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def _check_sizes(input_tokens: int, max_tokens: int, tokens_per_char: float, priority: str) -> Priority:
    if input_tokens < 0:
        raise ValueError(f"input_tokens must be >= 0; got {input_tokens}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1; got {max_tokens}")
    if not (tokens_per_char > 0 and math.isfinite(tokens_per_char)):
        raise ValueError(f"tokens_per_char must be finite and > 0; got {tokens_per_char}")
    return parse_priority(priority)


def _tags(content: str, budget_text: str, turns: int, system_text: str, input_tokens: int, max_tokens: int,
          tenant: str, priority: Priority, tokens_per_char: float) -> Tags:
    """Tags from the content to classify, the text whose length constraint caps this answer, and the structure."""
    limit, unit = parse_length_constraint(budget_text, tokens_per_char)
    budget = compute_output_budget(max_tokens, limit, unit, tokens_per_char)
    return Tags(
        input_tokens=input_tokens,
        language=detect_language(content),
        length_limit=limit,
        length_unit=unit,
        output_budget=budget,
        task=detect_task(content, turns),
        size_class=classify_size(budget),
        domain=detect_domain(content),
        audience=detect_audience(content),
        priority=priority,
        tenant=tenant,
        turns=turns,
        prefix_key=compute_prefix_key(system_text),
    )


def tag(
    prompt: str,
    input_tokens: int,
    max_tokens: int,
    *,
    tenant: str = "",
    priority: str = "",
    tokens_per_char: float = 1.0,
) -> Tags:
    """Tag one request; linear time in the prompt.

    Raises ValueError on a bad priority or nonsensical sizes, and nothing else:
    no prompt text makes it raise.
    """
    checked_priority = _check_sizes(input_tokens, max_tokens, tokens_per_char, priority)
    content = strip_role_markers(prompt)
    return _tags(content, content, count_turns(prompt), extract_system_prompt(prompt), input_tokens, max_tokens,
                 tenant, checked_priority, tokens_per_char)


def tag_conversation(
    messages: Sequence[tuple[str, str]],
    input_tokens: int,
    max_tokens: int,
    *,
    tenant: str = "",
    priority: str = "",
    tokens_per_char: float = 1.0,
) -> Tags:
    """Tag a conversation of (role, content) pairs; linear time in its contents.

    Its structure is given, not guessed from text: turns are the user messages, the system message (the
    first, if any) is the shared prefix (prefix_key), and more than one turn is the "chat" task. Language,
    task, domain and audience come from the system and user contents (the assistant's are the model's own
    words); the length constraint from the system message and the last user message, the ones this answer
    is asked under (an earlier "in 20 words" was for an earlier answer).

    Raises ValueError on a bad priority or nonsensical sizes, and nothing else.
    """
    checked_priority = _check_sizes(input_tokens, max_tokens, tokens_per_char, priority)
    system = messages[0][1].strip() if messages and messages[0][0] == "system" else ""
    users = [content for role, content in messages if role == "user"]
    content = "\n\n".join(c for role, c in messages if role != "assistant")
    budget_text = "\n\n".join(t for t in (system, users[-1] if users else "") if t)
    return _tags(content, budget_text, max(1, len(users)), system, input_tokens, max_tokens, tenant,
                 checked_priority, tokens_per_char)
