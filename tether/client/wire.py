"""What the sync and async clients share: building requests and turning responses into checked results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.client.errors import ReceiptMismatch
from tether.client.receipt import check_index, check_receipt
from tether.types import FINISH_REASONS, Delta, GenerateResult, Receipt
from tether.v1 import admission_pb2, common_pb2


def encode_prompt(prompt: str | bytes) -> bytes:
    # bytes pass through untouched so that callers (and tests) can send exactly what they mean, invalid UTF-8 too.
    return prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")


def generate_request(prompt: bytes, *, max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int,
                     stop: Sequence[str], ignore_eos: bool, tenant: str, priority: str,
                     request_id: str) -> admission_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                         seed=seed, stop=list(stop), ignore_eos=ignore_eos)
    return admission_pb2.GenerateRequest(prompt=prompt, sampling=sampling, tenant=tenant, priority=priority,
                                         request_id=request_id)


def tag_request(prompt: bytes, *, max_tokens: int, tenant: str, priority: str) -> admission_pb2.TagRequest:
    return admission_pb2.TagRequest(prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
                                    tenant=tenant, priority=priority)


def tags_dict(tags: common_pb2.IntentTags) -> dict[str, Any]:
    """Every IntentTags field by name, defaults included (MessageToDict would drop zeros and stringify fixed64)."""
    return {f.name: getattr(tags, f.name) for f in tags.DESCRIPTOR.fields}


def result_from_response(response: admission_pb2.GenerateResponse, prompt: bytes,
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

    def __init__(self, prompt: bytes, request_id: str) -> None:
        self._prompt = prompt
        self._request_id = request_id
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self.tags: dict[str, Any] = {}
        self.seed = 0
        self.internal_id = ""          # from the first chunk: the id admission minted for this request
        self.result: GenerateResult | None = None

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
