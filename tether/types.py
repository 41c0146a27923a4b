"""Result types shared by the SDK and the in-process reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tether.v1 import common_pb2

FINISH_REASONS: dict[int, str] = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_EOS: "eos",
    common_pb2.FINISH_REASON_CONTEXT: "context",
}


@dataclass(frozen=True)
class Receipt:
    request_id: str
    prompt_digest: int
    prompt_tokens: int
    context_hash: int
    output_tokens: int
    model_fingerprint: str
    internal_id: str = ""            # the id admission minted (request_id is the caller's own label)

    @classmethod
    def from_proto(cls, r: common_pb2.Receipt) -> "Receipt":
        return cls(r.request_id, r.prompt_digest, r.prompt_tokens, r.context_hash, r.output_tokens,
                   r.model_fingerprint, r.internal_id)


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str               # "length" | "stop" | "eos" | "context"
    receipt: Receipt
    tags: dict[str, Any] = field(default_factory=dict)
    seed: int = 0                    # the sampling seed used (admission draws one when sampling unseeded)


@dataclass(frozen=True)
class Delta:
    """One streamed piece: the token's index, its id and the text it completes (may be empty)."""

    index: int
    token_id: int
    text: str
    finish_reason: str = ""
