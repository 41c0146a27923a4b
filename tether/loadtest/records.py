"""What the load generator records per request: timings as measured, the served answer, and the audit verdict.

Plain data with derived timings, shared by the load generator, the statistics, the audit and the reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tether.loadtest.workloads import BenchRequest

# Intent tags worth breaking the figures down by (the rest are high-cardinality or constant in a bench).
BREAKDOWN_TAGS = ("language", "task", "size_class", "length_limited")


@dataclass
class RequestRecord:
    request: BenchRequest
    level: str                          # label of the load level this request belongs to
    start: float = 0.0                  # seconds from the level's start to sending the request
    ttft: float | None = None           # seconds from sending to the first token
    itl: list[float] = field(default_factory=list)   # seconds between successive tokens
    e2e: float | None = None            # seconds from sending to the end of the stream
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    seed: int = 0                       # the seed the server sampled with (admission draws one if unseeded)
    tags: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0              # from the receipt
    context_hash: int = 0               # from the receipt
    model_fingerprint: str = ""         # from the receipt
    error_code: str = ""                # gRPC status name of a failed request; "" when it completed
    error: str = ""
    verdict: str = ""                   # audit verdict (exact / within_margin / mismatch); "" = not audited
    audit_detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_code

    @property
    def output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (n - 1); undefined below two tokens."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def tag(self, name: str) -> str:
        """An intent tag's value as a group label; `length_limited` is derived from the length limit."""
        if not self.tags:
            return "unknown"     # failed before the first chunk: admission's tags never arrived
        if name == "length_limited":
            return "yes" if self.tags.get("length_limit") else "no"
        return str(self.tags.get(name, "unknown"))

    def to_json(self) -> dict[str, Any]:
        return dict(level=self.level, index=self.request.index, workload=self.request.workload,
                    prompt=self.request.prompt, params=self.request.params(), start_s=self.start,
                    ttft_s=self.ttft, tpot_s=self.tpot, e2e_s=self.e2e, itl_s=self.itl, token_ids=self.token_ids,
                    text=self.text, finish_reason=self.finish_reason, seed=self.seed,
                    output_budget=self.tags.get("output_budget"), tags={t: self.tag(t) for t in BREAKDOWN_TAGS},
                    prompt_tokens=self.prompt_tokens, error_code=self.error_code, error=self.error,
                    verdict=self.verdict, audit_detail=self.audit_detail)
