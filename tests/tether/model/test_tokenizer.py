"""The presets' byte-level tokenizer and the incremental detokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.generation.detokenizer import REPLACEMENT, IncrementalDetokenizer
from tether.model.loader import load_model_tokenizer, resolve_model
from tether.model.tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, Tokenizer

TEXTS = [
    "hello world",
    "你好，世界！今天天气怎么样？",
    "🙂🚀👨‍👩‍👧‍👦 emoji and 表情",
    "mixed 中文 English 日本語 한국어 العربية ñ é ü ß",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "数学公式：∑_{i=1}^{n} i² = n(n+1)(2n+1)/6",
    "",
    "a",
    "\x00\x01 control bytes \x7f",
    "𠜎𠜱𠝹𠱓 (4-byte CJK extension B)",
]

SPECIAL_STRINGS = ("<|bos|>", "<|eos|>", "<|pad|>")

# Text without lone surrogates (not encodable) and without U+FFFD (the detokenizer's "incomplete" marker);
# the special tokens' spellings are mixed in on purpose: typed in text they must stay plain bytes.
texts = st.one_of(
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=REPLACEMENT), max_size=40),
    st.lists(st.sampled_from([*SPECIAL_STRINGS, "a", "你", "🙂", "<|", "|>"]), max_size=8).map("".join),
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_model_tokenizer(resolve_model("tiny"))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_ids_are_utf8_bytes(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


@given(text=texts)
@settings(max_examples=200, deadline=None, database=None)
def test_round_trip_any_text(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", ["<|eos|>", "say <|bos|> hi", "<|pad|><|pad|>"])
def test_special_token_strings_in_text_are_plain_bytes(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_specials(tok):
    assert tok.vocab_size == 258 < BYTE_VOCAB_SIZE           # bytes + ChatML's 2; BOS/EOS/PAD are model ids only
    assert tok.eos_ids == frozenset({EOS_ID})
    assert tok.bos_id == BOS_ID and not tok.add_bos          # the byte tokenizer does not prepend BOS
    # special tokens are dropped from decoded text
    ids = [BOS_ID, *"你好".encode(), EOS_ID, PAD_ID, *b"!"]
    assert tok.decode(ids) == "你好!"
    assert tok.hf.token_to_id("<|eos|>") is None


def test_ids_past_the_vocabulary_decode_to_nothing(tok):
    """The model's head is padded to 272 rows; ids 259..271 have no text and must not break decoding."""
    assert tok.decode([*b"A", 259, 265, 271, *b"B"]) == "AB"
    d = IncrementalDetokenizer(tok)
    assert [d.push(i) for i in [*b"A", 265, *b"B"]] == ["A", "", "B"]
    assert d.flush() == ""


def _feed(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(tok)
    deltas = [d.push(i) for i in ids]
    return deltas, d.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_deltas_never_split_a_character(tok, text):
    ids = tok.encode(text)
    deltas, rest = _feed(tok, ids)
    assert rest == ""                                      # complete text: everything already emitted
    assert "".join(deltas) == text
    for delta in deltas:
        assert REPLACEMENT not in delta
    # a delta appears exactly when a character completes: after its last byte, never in the middle
    emitted = 0
    for i, delta in enumerate(deltas):
        emitted += len(delta.encode())
        assert emitted <= i + 1
        prefix = bytes(ids[: i + 1])
        try:
            prefix.decode("utf-8")
            complete = True
        except UnicodeDecodeError:
            complete = False
        assert (emitted == i + 1) == complete


def test_detokenizer_chinese_byte_by_byte(tok):
    text = "中文测试：拼音、汉字和标点。"
    ids = tok.encode(text)
    assert len(ids) == 3 * len(text)
    deltas, rest = _feed(tok, ids)
    assert rest == ""
    # every 3rd byte completes one character, the two before it emit nothing
    assert deltas == [c for ch in text for c in ("", "", ch)]


@given(text=texts)
@settings(max_examples=200, deadline=None, database=None)
def test_detokenizer_concatenates_to_full_decode(tok, text):
    ids = tok.encode(text)
    deltas, rest = _feed(tok, ids)
    assert "".join(deltas) + rest == tok.decode(ids) == text
    assert all(REPLACEMENT not in d for d in deltas)


def test_flush_emits_an_incomplete_tail(tok):
    ids = tok.encode("好的") + list("世".encode())[:2]   # the last character is cut after 2 of 3 bytes
    deltas, rest = _feed(tok, ids)
    assert "".join(deltas) == "好的"
    assert deltas[-2:] == ["", ""]
    assert rest == tok.decode(ids)[len("好的"):]
    assert rest and set(rest) == {REPLACEMENT}
    d = IncrementalDetokenizer(tok)
    for i in ids:
        d.push(i)
    d.flush()
    assert d.flush() == ""                                 # flush is idempotent


def test_flush_after_everything_emitted_is_empty(tok):
    d = IncrementalDetokenizer(tok)
    out = "".join(d.push(i) for i in tok.encode("abc 你"))
    assert out == "abc 你"
    assert d.flush() == ""


def test_detokenizer_skips_specials(tok):
    d = IncrementalDetokenizer(tok)
    ids = [*"ab".encode(), BOS_ID, *"你".encode(), EOS_ID, *"c".encode()]
    out = "".join(d.push(i) for i in ids) + d.flush()
    assert out == "ab你c"


def test_invalid_byte_does_not_stall_the_stream(tok):
    """A stray continuation byte decodes to U+FFFD once the next character arrives; text keeps flowing."""
    d = IncrementalDetokenizer(tok)
    ids = [*b"x", 0x80, *"好".encode(), *b"y"]
    deltas = [d.push(i) for i in ids]
    assert deltas == ["x", "", "", "", REPLACEMENT + "好", "y"]
    assert d.flush() == ""
    assert "".join(deltas) == tok.decode(ids)
