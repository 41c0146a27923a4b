"""A request's token sequence: finish reasons, stop strings, held-back text, running hash."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.generation.sequence import FinishReason, Sequence
from tether.model.loader import load_model_tokenizer, resolve_model
from tether.model.tokenizer import EOS_ID, Tokenizer
from tether.protocol.hashing import context_hash, hash_seed
from tether.reference import sampling_params

SEED = hash_seed("fp", "tenant")
PROMPT = list("Q: ".encode())


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_model_tokenizer(resolve_model("tiny"))


def make(tok, max_tokens=64, stop=(), ignore_eos=False, prompt=PROMPT, max_context=4096) -> Sequence:
    return Sequence("r1", list(prompt), sampling_params(max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos),
                    tok, SEED, max_context)


def feed(seq: Sequence, ids) -> list:
    outs = []
    for t in ids:
        outs.append(seq.append(t))
        if outs[-1].finish_reason:
            break
    return outs


def test_max_tokens_finishes_with_length(tok):
    seq = make(tok, max_tokens=3)
    outs = feed(seq, b"abcdef")
    assert [o.finish_reason for o in outs] == [0, 0, FinishReason.FINISH_REASON_LENGTH]
    assert [o.index for o in outs] == [0, 1, 2]
    assert seq.finished and seq.output_ids == list(b"abc") and seq.text == "abc"
    assert "".join(o.text for o in outs) == "abc"
    with pytest.raises(AssertionError):
        seq.append(ord("d"))


def test_length_flushes_a_partial_character(tok):
    seq = make(tok, max_tokens=2)
    outs = feed(seq, "好".encode())
    assert outs[-1].finish_reason == FinishReason.FINISH_REASON_LENGTH
    assert seq.text == tok.decode(list("好".encode())[:2]) and seq.text   # the incomplete tail, flushed


def test_eos_finishes_with_eos_and_adds_no_text(tok):
    seq = make(tok)
    outs = feed(seq, [*b"hi", EOS_ID, *b"never"])
    assert len(outs) == 3
    assert outs[-1].finish_reason == FinishReason.FINISH_REASON_EOS and outs[-1].text == ""
    assert seq.text == "hi" and seq.output_ids == [*b"hi", EOS_ID]


def test_ignore_eos_keeps_going(tok):
    seq = make(tok, max_tokens=5, ignore_eos=True)
    outs = feed(seq, [*b"hi", EOS_ID, *b"yo", *b"zz"])
    assert [o.finish_reason for o in outs] == [0, 0, 0, 0, FinishReason.FINISH_REASON_LENGTH]
    assert seq.output_ids == [*b"hi", EOS_ID, *b"yo"]
    assert seq.text == "hiyo"                          # the special decodes to nothing


def test_context_window_finishes_with_context(tok):
    seq = make(tok, max_tokens=100, max_context=len(PROMPT) + 4)
    outs = feed(seq, b"abcdefgh")
    assert len(outs) == 4 and outs[-1].finish_reason == FinishReason.FINISH_REASON_CONTEXT
    assert seq.text == "abcd"


def test_stop_string_cuts_text_and_finishes_with_stop(tok):
    seq = make(tok, stop=["END"])
    outs = feed(seq, b"hello END world")
    assert outs[-1].finish_reason == FinishReason.FINISH_REASON_STOP
    assert seq.text == "hello "
    assert "".join(o.text for o in outs) == "hello "
    assert seq.output_ids == list(b"hello END")        # the stop tokens were generated, not shown


def test_stop_string_spanning_two_tokens(tok):
    """Each byte is one token, so a 2-char stop spans two tokens; so does a stop string cut mid-character."""
    seq = make(tok, stop=["ab"])
    outs = feed(seq, b"xxaab")
    assert outs[-1].finish_reason == FinishReason.FINISH_REASON_STOP and seq.text == "xxa"
    assert [o.text for o in outs] == ["x", "x", "", "a", ""]  # each "a" held while it may start "ab"

    seq = make(tok, stop=["。"])
    outs = feed(seq, "你好。再见".encode())
    assert outs[-1].finish_reason == FinishReason.FINISH_REASON_STOP and seq.text == "你好"
    assert len(seq.output_ids) == 9


def test_stop_inside_a_single_multi_char_token_delta(tok):
    """Text arriving in one delta that contains the stop string in its middle is cut there."""
    seq = make(tok, stop=["好"])
    outs = feed(seq, "你好吗".encode())
    assert outs[-1].finish_reason == FinishReason.FINISH_REASON_STOP and seq.text == "你"


def test_first_of_several_stop_strings(tok):
    seq = make(tok, stop=["zzz", "c", "b"])
    feed(seq, b"aabcz")
    assert seq.finish_reason == FinishReason.FINISH_REASON_STOP and seq.text == "aa"


def test_held_back_prefix_is_released_when_it_does_not_complete(tok):
    seq = make(tok, stop=["STOP"])
    outs = feed(seq, b"aSTx")
    assert [o.text for o in outs] == ["a", "", "", "STx"]
    assert not seq.finished and seq.text == "aSTx"


def test_held_back_prefix_is_released_at_the_end(tok):
    seq = make(tok, max_tokens=4, stop=["xyz"])
    outs = feed(seq, b"abxy")
    assert [o.text for o in outs] == ["a", "b", "", "xy"]
    assert outs[-1].finish_reason == FinishReason.FINISH_REASON_LENGTH
    assert seq.text == "abxy"


def test_held_back_prefix_is_dropped_text_never_lost_at_eos(tok):
    seq = make(tok, stop=["xyz"])
    outs = feed(seq, [*b"abx", EOS_ID])
    assert outs[-1].finish_reason == FinishReason.FINISH_REASON_EOS
    assert seq.text == "abx"                                   # the held 'x' is released at the end
    assert "".join(o.text for o in outs) == "abx"


def test_running_hash_covers_prompt_and_output(tok):
    seq = make(tok, max_tokens=10)
    assert seq.hasher.value == context_hash(SEED, PROMPT)
    outs = feed(seq, b"abc")
    for i, o in enumerate(outs):
        assert o.context_hash == context_hash(SEED, PROMPT + list(b"abc"[: i + 1]))
    assert seq.all_ids == PROMPT + list(b"abc")


@given(text=st.text(alphabet="abcx好。 ", max_size=30), stop=st.lists(st.text(alphabet="abx好。", min_size=1,
                                                                                     max_size=3), max_size=3))
@settings(max_examples=200, deadline=None, database=None)
def test_stop_matches_python_find(tok, text, stop):
    """Text shown = the output cut before the first stop string to complete, else all of it."""
    ids = list(text.encode())
    seq = make(tok, max_tokens=max(1, len(ids)), stop=stop)
    outs = feed(seq, ids or list(b"q"))
    full = text or "q"
    shown = "".join(o.text for o in outs)
    assert shown == seq.text and full.startswith(shown)
    assert not any(s in shown for s in stop)
    if any(s in full for s in stop):
        assert seq.finish_reason == FinishReason.FINISH_REASON_STOP
        assert any(full[len(shown):].startswith(s) for s in stop)
    else:
        assert seq.finish_reason == FinishReason.FINISH_REASON_LENGTH
        assert shown == full
