"""Every validation rule of admission, and that each refusal names its field and the allowed range."""

from __future__ import annotations

import math

import pytest

from services.admission.validate import ModelLimits, ValidationError, validate
from tether import settings
from tether.v1 import admission_pb2, common_pb2

VOCAB = 272
CONTEXT = 4096


class ByteTokenizer:
    """One token per UTF-8 byte, like the presets' tokenizer, without loading a model."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


MODEL = ModelLimits(ByteTokenizer(), max_context=CONTEXT, vocab_size=VOCAB)


def request(prompt: bytes | str = "Hello", **fields) -> admission_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(**fields.pop("sampling", {}))
    data = prompt.encode() if isinstance(prompt, str) else prompt
    return admission_pb2.GenerateRequest(prompt=data, sampling=sampling, **fields)


def refused(req: admission_pb2.GenerateRequest, model: ModelLimits = MODEL) -> str:
    with pytest.raises(ValidationError) as e:
        validate(req, model)
    return str(e.value)


# ---- a valid request and its normalization ----------------------------------------------------------------

def test_valid_request_is_normalized():
    v = validate(request("你好 world", tenant="acme.prod-1", priority="critical", request_id="r-1"), MODEL)
    assert v.prompt == "你好 world"
    assert v.prompt_token_ids == list("你好 world".encode())
    assert v.tenant == "acme.prod-1" and v.priority == "critical" and v.request_id == "r-1"
    assert v.sampling.max_tokens == settings.DEFAULT_MAX_TOKENS
    assert v.sampling.seed == 0   # greedy: no seed needed


def test_validation_does_not_modify_the_request():
    req = request(sampling={"temperature": 0.7})
    validate(req, MODEL)
    assert req.sampling.max_tokens == 0 and req.sampling.seed == 0


def test_request_id_is_a_label_kept_as_sent():
    """Admission mints the internal id itself (door.py); the caller's id is only a label, "" when none."""
    assert validate(request(), MODEL).request_id == ""
    assert validate(request(request_id="mine"), MODEL).request_id == "mine"


def test_empty_priority_means_standard():
    assert validate(request(priority=""), MODEL).priority == "standard"


def test_sampled_request_without_seed_gets_a_63_bit_seed():
    v = validate(request(sampling={"temperature": 0.8}), MODEL)
    assert 0 < v.sampling.seed < 2 ** 63


def test_caller_seed_is_kept():
    v = validate(request(sampling={"temperature": 0.8, "seed": 42}), MODEL)
    assert v.sampling.seed == 42


def test_explicit_sampling_fields_are_kept():
    stop = ["\n\n", "END"]
    v = validate(request(sampling={"max_tokens": 5, "temperature": 2.0, "top_k": VOCAB, "top_p": 1.0,
                                   "stop": stop, "ignore_eos": True}), MODEL)
    s = v.sampling
    got = (s.max_tokens, s.temperature, s.top_k, s.top_p, list(s.stop), s.ignore_eos)
    assert got == (5, 2.0, VOCAB, 1.0, stop, True)


# ---- prompt ---------------------------------------------------------------------------------------------------

def test_invalid_utf8_names_byte_and_offset():
    msg = refused(request(b"abc\xff def"))
    assert msg == "prompt is not valid UTF-8 (invalid byte 0xff at offset 3)"


def test_truncated_multibyte_character_is_invalid_utf8():
    assert "invalid byte 0xe4 at offset 2" in refused(request("ab".encode() + "你".encode()[:2]))


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t "])
def test_empty_prompt(prompt):
    assert "prompt is empty" in refused(request(prompt))


def test_prompt_bytes_limit():
    class Words:
        def encode(self, text: str) -> list[int]:
            return [1] * max(1, len(text) // 100)
    validate(request("a" * settings.MAX_PROMPT_BYTES), ModelLimits(Words(), CONTEXT, VOCAB))
    msg = refused(request("a" * (settings.MAX_PROMPT_BYTES + 1)))
    assert "prompt" in msg and str(settings.MAX_PROMPT_BYTES) in msg and "bytes" in msg


def test_prompt_tokens_limit():
    big = ModelLimits(ByteTokenizer(), max_context=10 ** 6, vocab_size=VOCAB)
    validate(request("a" * settings.MAX_PROMPT_TOKENS), big)
    msg = refused(request("a" * (settings.MAX_PROMPT_TOKENS + 1)), big)
    assert "prompt" in msg and str(settings.MAX_PROMPT_TOKENS) in msg and "tokens" in msg


def test_prompt_that_tokenizes_to_nothing():
    class Empty:
        def encode(self, text: str) -> list[int]:
            return []
    assert "no tokens" in refused(request(), ModelLimits(Empty(), CONTEXT, VOCAB))


def test_prompt_plus_max_tokens_must_fit_the_context():
    small = ModelLimits(ByteTokenizer(), max_context=100, vocab_size=VOCAB)
    validate(request("a" * 90, sampling={"max_tokens": 10}), small)
    msg = refused(request("a" * 90, sampling={"max_tokens": 11}), small)
    assert "max_tokens" in msg and "context of 100 tokens" in msg and "at most 10" in msg


def test_default_max_tokens_counts_against_the_context():
    small = ModelLimits(ByteTokenizer(), max_context=100, vocab_size=VOCAB)
    assert "max_tokens (64)" in refused(request("a" * 40), small)


def test_prompt_filling_the_context_asks_for_a_shorter_prompt():
    small = ModelLimits(ByteTokenizer(), max_context=100, vocab_size=VOCAB)
    assert "shorten the prompt" in refused(request("a" * 100, sampling={"max_tokens": 1}), small)


# ---- sampling -------------------------------------------------------------------------------------------------

def test_max_tokens_range():
    assert validate(request(sampling={"max_tokens": 1}), MODEL).sampling.max_tokens == 1
    assert validate(request(sampling={"max_tokens": settings.MAX_OUTPUT_TOKENS}), MODEL)
    msg = refused(request(sampling={"max_tokens": settings.MAX_OUTPUT_TOKENS + 1}))
    assert "max_tokens" in msg and f"between 1 and {settings.MAX_OUTPUT_TOKENS}" in msg


@pytest.mark.parametrize("t", [-0.1, 2.01, math.nan, math.inf, -math.inf])
def test_temperature_range(t):
    msg = refused(request(sampling={"temperature": t}))
    assert "temperature" in msg and "between 0 and 2" in msg


@pytest.mark.parametrize("p", [-0.5, 1.5, math.nan])
def test_top_p_range(p):
    msg = refused(request(sampling={"top_p": p}))
    assert "top_p" in msg and "between 0 and 1" in msg


def test_top_k_range():
    validate(request(sampling={"top_k": VOCAB}), MODEL)
    msg = refused(request(sampling={"top_k": VOCAB + 1}))
    assert "top_k" in msg and str(VOCAB) in msg


def test_stop_count():
    validate(request(sampling={"stop": ["x"] * settings.MAX_STOP_SEQUENCES}), MODEL)
    msg = refused(request(sampling={"stop": ["x"] * (settings.MAX_STOP_SEQUENCES + 1)}))
    assert "stop" in msg and f"at most {settings.MAX_STOP_SEQUENCES}" in msg


def test_stop_sequence_must_not_be_empty():
    msg = refused(request(sampling={"stop": ["ok", ""]}))
    assert "stop[1]" in msg and f"1 to {settings.MAX_STOP_BYTES} bytes" in msg


def test_stop_sequence_size_counts_utf8_bytes():
    chars = settings.MAX_STOP_BYTES // 3
    validate(request(sampling={"stop": ["你" * chars]}), MODEL)
    msg = refused(request(sampling={"stop": ["你" * (chars + 1)]}))
    assert "stop[0]" in msg and f"{3 * (chars + 1)} bytes" in msg


# ---- identity fields ------------------------------------------------------------------------------------------

def test_priority_must_be_known():
    msg = refused(request(priority="urgent"))
    assert "priority" in msg and "critical" in msg and "sheddable" in msg


@pytest.mark.parametrize("tenant", ["a b", "acme/prod", "ténant", "x" * (settings.MAX_TENANT_CHARS + 1)])
def test_tenant_characters_and_length(tenant):
    msg = refused(request(tenant=tenant))
    assert "tenant" in msg and f"at most {settings.MAX_TENANT_CHARS}" in msg and "[A-Za-z0-9_.-]" in msg


def test_tenant_at_the_limit_is_fine():
    assert validate(request(tenant="t" * settings.MAX_TENANT_CHARS), MODEL).tenant == "t" * settings.MAX_TENANT_CHARS


@pytest.mark.parametrize("rid", ["tab\there", "é", "x" * (settings.MAX_REQUEST_ID_CHARS + 1)])
def test_request_id_printable_ascii_and_length(rid):
    msg = refused(request(request_id=rid))
    assert "request_id" in msg and f"at most {settings.MAX_REQUEST_ID_CHARS} printable ASCII" in msg
