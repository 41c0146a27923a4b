"""Client-side checks of an answer against the request that asked for it (docs/PROTOCOL.md "End-to-end receipt").

Pure functions, so each rule is testable without a server.
"""

from __future__ import annotations

from collections.abc import Sequence

from tether.client.errors import ReceiptMismatch
from tether.protocol.hashing import messages_digest, prompt_digest
from tether.types import Receipt

# What a client sent, as the receipt digests it: the prompt's bytes, or the conversation's (role, content bytes).
Sent = bytes | Sequence[tuple[str, bytes]]


def sent_digest(sent: Sent) -> int:
    """The prompt_digest a receipt must carry for `sent` (docs/PROTOCOL.md "End-to-end receipt")."""
    return prompt_digest(sent) if isinstance(sent, bytes) else messages_digest(sent)


def check_index(expected: int, index: int) -> None:
    """Streamed tokens must arrive with indices 0, 1, 2, ...: a gap or repeat means a lost or foreign token."""
    if index != expected:
        raise ReceiptMismatch(f"token index {index} arrived where {expected} was expected; "
                              f"the stream lost, repeated or reordered tokens")


def check_receipt(receipt: Receipt, prompt: Sent, token_ids: Sequence[int], request_id: str = "") -> None:
    """Raise ReceiptMismatch unless `receipt` vouches for this prompt (bytes) or conversation ((role, content
    bytes) pairs), these tokens and this request id (the caller's label, echoed as sent: "" when it sent none)."""
    expected = sent_digest(prompt)
    if receipt.prompt_digest != expected:
        what = "prompt" if isinstance(prompt, bytes) else "conversation"
        raise ReceiptMismatch(f"receipt's prompt digest {receipt.prompt_digest:016x} differs from {expected:016x}, "
                              f"the digest of the {what} this client sent: the answer is for another {what}")
    if receipt.request_id != request_id:
        raise ReceiptMismatch(f"receipt is for request {receipt.request_id!r}, but this client sent {request_id!r}")
    if receipt.output_tokens != len(token_ids):
        raise ReceiptMismatch(f"receipt counts {receipt.output_tokens} output tokens, "
                              f"but {len(token_ids)} were received")
