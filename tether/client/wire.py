"""What the sync and async clients share: building requests and turning responses into checked results."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Union

from tether.client.errors import ReceiptMismatch
from tether.client.receipt import Sent, check_index, check_receipt
from tether import types
from tether.types import FINISH_REASONS, Delta, Receipt
from tether.v1 import admission_pb2, common_pb2


@dataclasses.dataclass
class GenerateResult(types.GenerateResult):
    """A checked answer (tether.types.GenerateResult) plus what the SDK knows of the call that got it:
    `attempts`, 1 when the first attempt answered, 2 when it was refused or failed and the first retry
    answered (tether.client.retry), and so on."""

    attempts: int = 1


def encode_prompt(prompt: str | bytes) -> bytes:
    # bytes pass through untouched so that callers (and tests) can send exactly what they mean, invalid UTF-8 too.
    return prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")


# A conversation as callers write it: [{"role": "user", "content": "Hi"}, ...] or [("user", "Hi"), ...].
Messages = Sequence[Union[Mapping[str, Any], tuple[str, Union[str, bytes]]]]


def encode_messages(messages: Messages) -> tuple[tuple[str, bytes], ...]:
    """(role, content bytes) pairs from dicts or tuples; contents as encode_prompt sends them.

    Only the shape is checked here (TypeError/ValueError): roles, order and sizes are admission's rules, so
    that one place decides them and says why (INVALID_ARGUMENT).
    """
    if isinstance(messages, (str, bytes, Mapping)):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts or (role, content) tuples; "
                        "for a single prompt use generate()")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping):
            if "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] needs 'role' and 'content' keys; got {sorted(map(str, m))}")
            role, content = m["role"], m["content"]
        elif isinstance(m, (tuple, list)) and len(m) == 2:
            role, content = m
        else:
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content' or a (role, content) tuple; "
                            f"got {type(m).__name__}")
        if not isinstance(role, str) or not isinstance(content, (str, bytes)):
            raise TypeError(f"messages[{i}]: role must be a str and content a str or bytes; "
                            f"got {type(role).__name__} and {type(content).__name__}")
        out.append((role, encode_prompt(content)))
    return tuple(out)


def _message_protos(messages: Sequence[tuple[str, bytes]]) -> list[admission_pb2.Message]:
    return [admission_pb2.Message(role=role, content=content) for role, content in messages]


def generate_request(prompt: bytes, *, max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
                     stop: Sequence[str], ignore_eos: bool, tenant: str, priority: str, request_id: str,
                     messages: Sequence[tuple[str, bytes]] = ()) -> admission_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                         seed=seed, stop=list(stop), ignore_eos=ignore_eos)
    return admission_pb2.GenerateRequest(prompt=prompt, sampling=sampling, tenant=tenant, priority=priority,
                                         request_id=request_id, messages=_message_protos(messages))


def tag_request(prompt: bytes, *, max_tokens: int, tenant: str, priority: str,
                messages: Sequence[tuple[str, bytes]] = ()) -> admission_pb2.TagRequest:
    return admission_pb2.TagRequest(prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
                                    tenant=tenant, priority=priority, messages=_message_protos(messages))


def sent_and_request(prompt: str | bytes | None, messages: Messages | None,
                     **fields: Any) -> tuple[Sent, admission_pb2.GenerateRequest]:
    """What the receipt must vouch for, and the request: from a prompt or from a conversation."""
    if messages is not None:
        pairs = encode_messages(messages)
        return pairs, generate_request(b"", messages=pairs, **fields)
    data = encode_prompt(prompt if prompt is not None else b"")
    return data, generate_request(data, **fields)


def tags_dict(tags: common_pb2.IntentTags) -> dict[str, Any]:
    """Every IntentTags field by name, defaults included (MessageToDict would drop zeros and stringify fixed64)."""
    return {f.name: getattr(tags, f.name) for f in tags.DESCRIPTOR.fields}


def result_from_response(response: admission_pb2.GenerateResponse, prompt: Sent,
                         request_id: str) -> GenerateResult:
    """The checked result of a unary Generate; raises ReceiptMismatch when the receipt does not vouch for it."""
    if not response.HasField("receipt"):
        raise ReceiptMismatch("the response carries no receipt")
    receipt = Receipt.from_proto(response.receipt)
    token_ids = list(response.token_ids)
    check_receipt(receipt, prompt, token_ids, request_id)
    return GenerateResult(response.text, token_ids, FINISH_REASONS[response.finish_reason], receipt,
                          tags_dict(response.tags), response.seed)


class StreamAssembler:
    """Checks streamed chunks as they arrive and assembles the final GenerateResult.

    The receipt is checked when the final chunk arrives, before its Delta is handed out, so a caller never
    sees the end of an answer whose receipt failed.
    """

    def __init__(self, prompt: Sent, request_id: str, after: "StreamAssembler | None" = None) -> None:
        """`after`: the assembler of an attempt that broke; this one carries on after its tokens (a resumed
        call's chunks start at their count, and its receipt covers them all)."""
        self._prompt = prompt
        self._request_id = request_id
        self._text: list[str] = list(after._text) if after else []
        self._token_ids: list[int] = list(after._token_ids) if after else []
        self.tags: dict[str, Any] = dict(after.tags) if after else {}
        self.seed: int = after.seed if after else 0
        self.internal_id: str = after.internal_id if after else ""   # from the first chunk: the id admission minted
        self.result: GenerateResult | None = None

    @property
    def token_ids(self) -> list[int]:
        """The tokens handed out so far (a copy)."""
        return list(self._token_ids)

    def add(self, chunk: admission_pb2.GenerateChunk) -> Delta:
        if self.result is not None:
            raise ReceiptMismatch(f"a chunk (index {chunk.index}) arrived after the final one")
        check_index(len(self._token_ids), chunk.index)
        if chunk.HasField("tags"):
            self.tags = tags_dict(chunk.tags)
            self.seed = chunk.seed
            self.internal_id = chunk.internal_id
        self._text.append(chunk.text)
        self._token_ids.append(chunk.token_id)
        finish = FINISH_REASONS[chunk.finish_reason]
        if finish:
            if not chunk.HasField("receipt"):
                raise ReceiptMismatch("the final chunk carries no receipt")
            receipt = Receipt.from_proto(chunk.receipt)
            check_receipt(receipt, self._prompt, self._token_ids, self._request_id)
            self.result = GenerateResult("".join(self._text), list(self._token_ids), finish, receipt, self.tags,
                                         self.seed)
        return Delta(chunk.index, chunk.token_id, chunk.text, finish)

    def finish(self) -> GenerateResult:
        """The result once the stream ended; a stream that ended without its final chunk is an error."""
        if self.result is None:
            raise ReceiptMismatch(f"the stream ended after {len(self._token_ids)} tokens without a final chunk")
        return self.result
