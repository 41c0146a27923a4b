"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

from tether.model.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a window of recent tokens and emits only text that can no longer change.

    A delta is held back while the window's text ends in U+FFFD (an incomplete UTF-8 sequence that the
    next byte token may finish); `flush` emits the rest at the end of the sequence.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0   # window start
        self.read_offset = 0     # tokens already turned into emitted text

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tok.decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith(REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""

    def flush(self) -> str:
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tok.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]
