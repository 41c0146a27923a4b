"""OpenAI JSON <-> the front door's messages, with no I/O: a request body to a GenerateRequest, the door's
events to chat/completion objects and stream chunks, a `Rejected` or a bad body to OpenAI's error shape.

Kept pure so that what the HTTP face means is readable (and tested) apart from the web framework.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import grpc
from pydantic import ValidationError

from services.admission.openai_api.schema import ChatCompletionRequest, CompletionRequest
from services.admission.outcome import Admitted
from services.admission.status import FINISH_REASONS, Rejected
from tether.v1 import admission_pb2, common_pb2

# The fields OpenAI defines that tether does not implement: a value other than the neutral one is refused.
UNIMPLEMENTED = frozenset({"n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "tools",
                           "tool_choice", "parallel_tool_calls", "response_format", "echo", "suffix", "best_of"})

# gRPC code -> (HTTP status, OpenAI error type): the statuses the OpenAI SDKs act on (429 and 5xx are retried).
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.ABORTED: (503, "service_unavailable_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
FINISH: dict[int, str] = {common_pb2.FINISH_REASON_LENGTH: "length", common_pb2.FINISH_REASON_CONTEXT: "length",
          common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_EOS: "stop"}


class BadRequest(Exception):
    """A body that does not say what tether can do: a 400 naming the field (`param`)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


# ---- errors ---------------------------------------------------------------------------------------------

def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def rejected_response(e: Rejected) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error body, headers) of a refusal; Retry-After (whole seconds, rounded up) and
    retry-after-ms (exact, which the OpenAI SDKs prefer) carry its RetryInfo delay."""
    status, type_ = HTTP_STATUS.get(e.code, (500, "internal_error"))
    headers = {}
    if e.retry_after_s is not None:
        headers = {"retry-after": str(max(1, math.ceil(e.retry_after_s))),
                   "retry-after-ms": str(max(1, round(e.retry_after_s * 1000)))}
    return status, error_body(e.message, type_, e.code.name.lower()), headers


def validation_message(error: ValidationError | list[dict]) -> BadRequest:
    """The first problem pydantic found, as 'field: what is wrong' (the field in OpenAI's dotted/indexed form)."""
    errors = error.errors() if isinstance(error, ValidationError) else error
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ""
    for p in loc:
        param += f"[{p}]" if p.isdigit() else (f".{p}" if param else p)
    if first.get("type") == "extra_forbidden":
        return BadRequest(param, f"unsupported field {param!r}: tether does not implement it (docs/PROTOCOL.md, "
                                 f"'The OpenAI-compatible HTTP API' lists the fields it does)")
    top = loc[0] if loc else ""
    if top in UNIMPLEMENTED:
        return BadRequest(param, f"{param}: tether implements only the neutral value of this field "
                                 f"({first.get('msg', 'invalid')})")
    if first.get("type") == "json_invalid":
        return BadRequest(None, f"the body is not valid JSON: {first.get('msg')}")
    return BadRequest(param or None, f"{param or 'body'}: {first.get('msg', 'invalid')}")


# ---- requests -------------------------------------------------------------------------------------------

def generate_request(body: ChatCompletionRequest | CompletionRequest, label: str, priority: str,
                     ) -> admission_pb2.GenerateRequest:
    """The GenerateRequest a body means. `label`/`priority`: from the body or else the x-request-id /
    x-priority headers (the face resolves which)."""
    sampling = common_pb2.SamplingParams(
        # OpenAI's default temperature is 1: sampling, with a seed admission draws (returned in `tether.seed`).
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p or 0.0, top_k=body.top_k or 0, seed=body.seed or 0, ignore_eos=body.ignore_eos)
    request = admission_pb2.GenerateRequest(sampling=sampling, tenant=body.tenant or "", priority=priority,
                                            request_id=label)
    sampling = request.sampling   # the constructor copied it: fill in the request's own
    if body.stop is not None:
        sampling.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if isinstance(body, ChatCompletionRequest):
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise BadRequest("max_completion_tokens", "max_tokens and max_completion_tokens differ; send one")
        sampling.max_tokens = body.max_completion_tokens or body.max_tokens or 0
        for m in body.messages:
            text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
            role = "system" if m.role == "developer" else m.role
            request.messages.append(admission_pb2.Message(role=role, content=text.encode("utf-8")))
    else:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise BadRequest("prompt", f"prompt: tether answers one prompt per request; got a list of {len(prompts)}")
        sampling.max_tokens = body.max_tokens or 0
        request.prompt = prompts[0].encode("utf-8")
    return request


# ---- responses ------------------------------------------------------------------------------------------

def tether_object(a: Admitted, tags: common_pb2.IntentTags, receipt: common_pb2.Receipt | None,
                  finish: int = 0) -> dict:
    """tether's own fields, riding along in `tether` (clients ignore what they do not know): the receipt
    (64-bit digests as 16 hex digits: JSON numbers lose them), the intent tags and the sampling seed used."""
    out: dict[str, Any] = {"internal_id": a.internal_id, "seed": a.valid.sampling.seed,
                           "tags": _tags_dict(tags)}
    if finish:
        out["finish_reason"] = FINISH_REASONS.get(finish, "unknown")   # tether's own: eos, stop, length, context
    if receipt is not None:
        out["receipt"] = {"request_id": receipt.request_id, "internal_id": receipt.internal_id,
                          "prompt_digest": f"{receipt.prompt_digest:016x}",
                          "context_hash": f"{receipt.context_hash:016x}",
                          "prompt_tokens": receipt.prompt_tokens, "output_tokens": receipt.output_tokens,
                          "model_fingerprint": receipt.model_fingerprint}
    return out


def _tags_dict(tags: common_pb2.IntentTags) -> dict:
    out = {f.name: getattr(tags, f.name) for f in tags.DESCRIPTOR.fields}
    out["prefix_key"] = f"{tags.prefix_key:016x}"
    return out


def usage(receipt: common_pb2.Receipt) -> dict:
    return {"prompt_tokens": receipt.prompt_tokens, "completion_tokens": receipt.output_tokens,
            "total_tokens": receipt.prompt_tokens + receipt.output_tokens}


@dataclasses.dataclass
class Shape:
    """One answer's constant parts: chat or completion, its id, creation time and model name."""

    chat: bool
    id: str
    created: int
    model: str
    fingerprint: str

    def _base(self, stream: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def answer(self, text: str, finish: int, receipt: common_pb2.Receipt, tether: dict,
               token_ids: list[int] | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": FINISH.get(finish, "stop")}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": FINISH.get(finish, "stop")}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._base(False), "choices": [choice], "usage": usage(receipt), "tether": tether}

    def chunk(self, text: str | None = None, *, role: bool = False, finish: int | None = None,
              with_usage: bool = False, tether: dict | None = None, token_ids: list[int] | None = None) -> dict:
        """A stream chunk: the role delta (chat's first), a content delta, or the finish chunk."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": None}
        if finish is not None:
            choice["finish_reason"] = FINISH.get(finish, "stop")
        if token_ids is not None:
            choice["token_ids"] = token_ids
        out = {**self._base(True), "choices": [choice]}
        if with_usage:
            out["usage"] = None   # as OpenAI: every chunk but the last carries a null usage when it is asked for
        if tether is not None:
            out["tether"] = tether
        return out

    def usage_chunk(self, receipt: common_pb2.Receipt, tether: dict) -> dict:
        return {**self._base(True), "choices": [], "usage": usage(receipt), "tether": tether}
