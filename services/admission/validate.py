"""Validate and normalize a GenerateRequest before it costs anything downstream.

Pure: no gRPC, no I/O. Every refusal is a `ValidationError` whose message names the field and the allowed
range, because it goes to the caller verbatim as an INVALID_ARGUMENT status.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass
from typing import Protocol

from tether import settings
from tether.model.chat_template import ChatTemplate, ChatTokenizer, ConversationError, tokenize_conversation
from tether.priority import Priority
from tether.priority import parse as parse_priority
from tether.v1 import admission_pb2, common_pb2

_TENANT = re.compile(r"[A-Za-z0-9_.-]*")
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]*")


class ValidationError(ValueError):
    """A request the caller must fix; the message says what and how."""


class Encoder(ChatTokenizer, Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model."""

    tokenizer: Encoder
    max_context: int   # max_position_embeddings: prompt + output must fit
    vocab_size: int    # upper bound of top_k
    chat_template: ChatTemplate | None = None   # None: the model takes raw prompts only


@dataclass(frozen=True)
class ValidRequest:
    prompt: str                              # the decoded prompt, or the conversation rendered with the chat template
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams      # a normalized copy: max_tokens and (when sampling) seed filled in
    tenant: str
    priority: Priority
    request_id: str                          # the caller's label ("" when none): never a key downstream
    messages: tuple[tuple[str, str], ...] = ()   # the decoded conversation, () for a raw prompt
    resume_token_ids: tuple[int, ...] = ()   # output already produced by an earlier attempt (a resume)


def validate(request: admission_pb2.GenerateRequest, model: ModelLimits) -> ValidRequest:
    """Check every field of `request` against the settings and `model`; raise ValidationError on the first bad one."""
    # The cheap fields first: tokenizing is the costly step, and the last.
    tenant = _check_tenant(request.tenant)
    priority = _check_priority(request.priority)
    request_id = _check_request_id(request.request_id)
    sampling = _normalize_sampling(request.sampling, model.vocab_size)
    if request.messages:
        if request.prompt:
            raise ValidationError("send either prompt or messages, not both")
        messages = _decode_messages(request.messages)
        try:
            # Contents never make control tokens: a message cannot forge a turn (chat_template.py).
            prompt, token_ids = tokenize_conversation(model.chat_template, model.tokenizer, messages)
        except ConversationError as e:
            raise ValidationError(str(e)) from None
        if not prompt.strip():
            raise ValidationError("the model's chat template rendered the conversation to empty text")
    else:
        messages = ()
        prompt = _decode_prompt(request.prompt)
        token_ids = model.tokenizer.encode(prompt)   # a raw prompt is the caller's own text: its controls stand
    _check_lengths(len(token_ids), sampling.max_tokens, model.max_context,
                   "conversation (rendered with the chat template)" if messages else "prompt")
    resume = _check_resume(request, sampling, model.vocab_size)
    return ValidRequest(prompt, token_ids, sampling, tenant, priority, request_id, messages, resume)


def _check_resume(request: admission_pb2.GenerateRequest, sampling: common_pb2.SamplingParams,
                  vocab_size: int) -> tuple[int, ...]:
    """Resumed tokens are context like the prompt, checked like it; they must leave something to generate
    (`check_resume_budget` once the output budget is known) and, when sampling, come with the seed the first
    attempt was given (a drawn seed would continue a different answer)."""
    resume = tuple(request.resume_tokens)
    if not resume:
        return resume
    if len(resume) >= sampling.max_tokens:
        raise ValidationError(f"resume_tokens holds {len(resume)} tokens; at most max_tokens - 1 "
                              f"({sampling.max_tokens - 1}) can be resumed from")
    if max(resume) >= vocab_size:
        raise ValidationError(f"resume_tokens has a token id >= the vocabulary size {vocab_size}")
    if sampling.temperature > 0 and request.sampling.seed == 0:
        raise ValidationError("resume_tokens with temperature > 0 needs the seed the first attempt was given "
                              "(its first chunk's seed): another seed would continue a different answer")
    return resume


def check_resume_budget(valid: ValidRequest, output_budget: int) -> None:
    """A resumed request must have output budget left after its resumed tokens (the budget counts them)."""
    if len(valid.resume_token_ids) >= output_budget:
        raise ValidationError(f"resume_tokens holds {len(valid.resume_token_ids)} tokens: the request's output "
                              f"budget of {output_budget} is already spent")


def _decode_prompt(raw: bytes) -> str:
    # Size first: no point decoding 10 MB to refuse it afterwards.
    if len(raw) > settings.MAX_PROMPT_BYTES:
        raise ValidationError(f"prompt is {len(raw)} bytes; at most {settings.MAX_PROMPT_BYTES} bytes are allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        message = f"prompt is not valid UTF-8 (invalid byte 0x{raw[e.start]:02x} at offset {e.start})"
        raise ValidationError(message) from None
    if not text.strip():
        raise ValidationError("prompt is empty; send at least one non-whitespace character, "
                              "or a conversation in messages")
    return text


def _decode_messages(messages) -> tuple[tuple[str, str], ...]:
    """(role, content) pairs with the contents decoded; sizes first, as for a prompt. Roles, order and empty
    contents are the chat template module's rules (shared with tether.reference)."""
    if len(messages) > settings.MAX_MESSAGES:
        raise ValidationError(f"messages holds {len(messages)} messages; at most {settings.MAX_MESSAGES} are allowed")
    total = sum(len(m.content) for m in messages)
    if total > settings.MAX_PROMPT_BYTES:
        raise ValidationError(f"the messages' contents are {total} bytes in all; at most {settings.MAX_PROMPT_BYTES} "
                              f"bytes are allowed (a conversation is never truncated: drop or shorten messages)")
    out = []
    for i, m in enumerate(messages):
        try:
            out.append((m.role, m.content.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise ValidationError(f"messages[{i}].content is not valid UTF-8 "
                                  f"(invalid byte 0x{m.content[e.start]:02x} at offset {e.start})") from None
    return tuple(out)


def _check_tenant(tenant: str) -> str:
    if len(tenant) > settings.MAX_TENANT_CHARS or not _TENANT.fullmatch(tenant):
        raise ValidationError(f"tenant must be at most {settings.MAX_TENANT_CHARS} characters of "
                              f"[A-Za-z0-9_.-]; got {tenant[:80]!r}")
    return tenant


def _check_priority(priority: str) -> Priority:
    try:
        return parse_priority(priority)
    except ValueError as e:
        raise ValidationError(str(e)) from None


def _check_request_id(request_id: str) -> str:
    if len(request_id) > settings.MAX_REQUEST_ID_CHARS or not _PRINTABLE_ASCII.fullmatch(request_id):
        raise ValidationError(f"request_id must be at most {settings.MAX_REQUEST_ID_CHARS} printable ASCII "
                              f"characters; got {request_id[:160]!r}")
    return request_id   # a label: admission mints the internal id every piece of state is keyed by


def _normalize_sampling(given: common_pb2.SamplingParams, vocab_size: int) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    s.CopyFrom(given)
    if s.max_tokens == 0:
        s.max_tokens = settings.DEFAULT_MAX_TOKENS
    elif s.max_tokens > settings.MAX_OUTPUT_TOKENS:
        raise ValidationError(f"max_tokens must be between 1 and {settings.MAX_OUTPUT_TOKENS} "
                              f"(0 means {settings.DEFAULT_MAX_TOKENS}); got {s.max_tokens}")
    # `not (lo <= x <= hi)` also rejects NaN, which compares false with everything.
    if not (math.isfinite(s.temperature) and 0.0 <= s.temperature <= settings.MAX_TEMPERATURE):
        raise ValidationError(f"temperature must be a finite number between 0 and {settings.MAX_TEMPERATURE:g} "
                              f"(0 = greedy); got {s.temperature:g}")
    if not 0.0 <= s.top_p <= 1.0:
        raise ValidationError(f"top_p must be between 0 and 1 (0 or 1 = off); got {s.top_p:g}")
    if s.top_k > vocab_size:
        raise ValidationError(f"top_k must be between 0 and the vocabulary size {vocab_size} (0 = off); got {s.top_k}")
    _check_stop(list(s.stop))
    if s.temperature > 0 and s.seed == 0:
        # Drawn here, once, and sent back in the response: replays inside the pipeline sample the same tokens,
        # and the caller can reproduce the answer by sending this seed.
        s.seed = secrets.randbits(63) or 1
    return s


def _check_stop(stop: list[str]) -> None:
    if len(stop) > settings.MAX_STOP_SEQUENCES:
        raise ValidationError(f"stop may hold at most {settings.MAX_STOP_SEQUENCES} sequences; got {len(stop)}")
    for i, seq in enumerate(stop):
        size = len(seq.encode("utf-8"))
        if not 1 <= size <= settings.MAX_STOP_BYTES:
            raise ValidationError(f"stop[{i}] must be 1 to {settings.MAX_STOP_BYTES} bytes of UTF-8; got {size} bytes")


def _check_lengths(prompt_tokens: int, max_tokens: int, max_context: int, what: str = "prompt") -> None:
    # A conversation over a limit is refused, never cut to fit: silently dropping earlier turns gives answers
    # that miss the question, so the caller decides what to drop.
    shorten = "drop or shorten messages" if what != "prompt" else "shorten the prompt"
    if prompt_tokens == 0:
        raise ValidationError(f"{what} tokenizes to no tokens; send some text")
    if prompt_tokens > settings.MAX_PROMPT_TOKENS:
        raise ValidationError(f"{what} is {prompt_tokens} tokens; at most {settings.MAX_PROMPT_TOKENS} tokens are "
                              f"allowed" + ("" if what == "prompt" else f"; {shorten}"))
    if prompt_tokens + max_tokens > max_context:
        room = max_context - prompt_tokens
        hint = f"lower max_tokens to at most {room}" if room > 0 else shorten
        raise ValidationError(f"{what} ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                              f"context of {max_context} tokens; {hint}")
