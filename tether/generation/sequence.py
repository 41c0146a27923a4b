"""One request's token sequence and the rules that end it: shared by the coordinator and the reference,
so both stop at exactly the same token for the same outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.generation.detokenizer import IncrementalDetokenizer
from tether.model.tokenizer import Tokenizer
from tether.protocol.hashing import ContextHasher
from tether.v1 import common_pb2

FinishReason = common_pb2.FinishReason


@dataclass
class TokenOut:
    """What appending one token produced: its index, the text delta, and whether the sequence ended."""

    index: int
    token_id: int
    text: str
    finish_reason: int = FinishReason.FINISH_REASON_UNSPECIFIED
    context_hash: int = 0


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams
    tokenizer: Tokenizer
    hash_seed: int
    max_context: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""                       # emitted text (stop sequences cut off)
    finish_reason: int = FinishReason.FINISH_REASON_UNSPECIFIED

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer)
        self.hasher = ContextHasher(self.hash_seed)
        self.hasher.extend(self.prompt_ids)
        self._pending = ""               # decoded text held back while it may be the start of a stop string
        self._all = self.prompt_ids + self.output_ids   # kept whole: the scheduler reads it every step

    @property
    def finished(self) -> bool:
        return self.finish_reason != FinishReason.FINISH_REASON_UNSPECIFIED

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output ids: the sequence's own list, maintained as tokens arrive (read it, never
        change it)."""
        return self._all

    def resume(self, token_ids: list[int]) -> None:
        """Start after output tokens already produced and passed on (a resumed request): they are replayed
        through the same rules as if sampled now, so the detokenizer's held bytes, a stop string's held prefix,
        the context hash and the budget are exactly where the uninterrupted run had them, and their text counts
        as already emitted. ValueError if they already end the sequence (nothing is left to generate)."""
        assert not self.output_ids, "resume() starts a fresh sequence"
        for i, token_id in enumerate(token_ids):
            self.append(token_id)
            if self.finished:
                raise ValueError(f"resume_tokens end the generation at token {i} "
                                 f"({FinishReason.Name(self.finish_reason)}); nothing is left to generate")

    def append(self, token_id: int) -> TokenOut:
        """Add a sampled token; returns the text that may be shown and, if it ended, why."""
        assert not self.finished, "token appended to a finished sequence"
        self.output_ids.append(token_id)
        self._all.append(token_id)
        self.hasher.extend([token_id])
        is_eos = token_id in self.tokenizer.eos_ids and not self.sampling.ignore_eos
        new = self.detok.flush() if is_eos else self.detok.push(token_id)   # EOS: emit a held partial char
        reason = FinishReason.FINISH_REASON_UNSPECIFIED
        if is_eos:
            reason = FinishReason.FINISH_REASON_EOS
        elif len(self.output_ids) >= self.sampling.max_tokens:
            reason = FinishReason.FINISH_REASON_LENGTH
        elif len(self.prompt_ids) + len(self.output_ids) >= self.max_context:
            reason = FinishReason.FINISH_REASON_CONTEXT
        if reason != FinishReason.FINISH_REASON_UNSPECIFIED and not is_eos:
            new += self.detok.flush()
        delta, stopped = self._apply_stop(new, final=reason != FinishReason.FINISH_REASON_UNSPECIFIED)
        if stopped:
            reason = FinishReason.FINISH_REASON_STOP
        self.text += delta
        self.finish_reason = reason
        return TokenOut(len(self.output_ids) - 1, token_id, delta, reason, self.hasher.value)

    def _apply_stop(self, new: str, final: bool) -> tuple[str, bool]:
        """Cut at the first stop string; hold back a tail that could still grow into one."""
        buf = self._pending + new
        stops = [s for s in self.sampling.stop if s]
        for s in stops:
            at = buf.find(s)
            if at >= 0:
                self._pending = ""
                return buf[:at], True
        if final or not stops:
            self._pending = ""
            return buf, False
        hold = 0
        for s in stops:  # longest suffix of buf that is a proper prefix of some stop string
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False
