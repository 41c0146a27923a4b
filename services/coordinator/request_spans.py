"""The coordinator's spans of a traced request (tracing on only): one span per request with a span per phase
(queue, prefill, decode) under it, and recovery events on it; nothing per token."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.coordinator.scheduler import Request
from tether.telemetry import tracing
from tether.v1 import common_pb2, stage_pb2

if TYPE_CHECKING:
    from services.coordinator.driver import Failure


def finish_reason_name(reason: int) -> str:
    """FINISH_REASON_STOP -> "stop" (gen_ai.response.finish_reasons, as admission's metrics name them)."""
    try:
        return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
    except ValueError:
        return f"unknown_{reason}"


class RequestSpans:
    """The coordinator's spans of one traced request (only while tracing is on): `coordinator request`, child
    of admission's span, and under it one phase span at a time, `coordinator queue` (submitted until its first
    frame), `coordinator prefill` (first frame until its first token; an event per prefill chunk) and
    `coordinator decode` (first token to the end). Rebuilds, resumes, resyncs, prefix misses and preemptions
    are events of the request span with their reason; per-token work adds nothing. Its traceparent travels in
    every slot of the request, so each stage's span of it is its child."""

    __slots__ = ("span", "phase", "phase_name", "traceparent", "trace_id", "outcome")

    def __init__(self, req: Request, parent: str, label: str) -> None:
        attributes: dict[str, str | int | float] = {
            "tether.request_id": req.id, "tether.tenant": req.tenant, "tether.priority": req.priority,
            "gen_ai.request.max_tokens": req.seq.sampling.max_tokens,
            "gen_ai.request.temperature": req.seq.sampling.temperature,
            "gen_ai.usage.input_tokens": len(req.seq.all_ids)}
        if label:
            attributes["tether.label"] = label
        self.span = tracing.start("coordinator request", tracing.parent(parent), tracing.SpanKind.SERVER, attributes)
        recording = self.span.is_recording()
        self.traceparent = tracing.traceparent(self.span) if recording else ""   # "" : the stages do nothing
        self.trace_id = tracing.trace_id(self.span) if recording else None
        self.phase_name = "queue"
        self.phase = tracing.start("coordinator queue", tracing.child_of(self.span))
        self.outcome: str | None = None   # the finish reason, once the last token is appended

    def next_phase(self, name: str, attributes: dict | None = None) -> None:
        self.phase.end()
        self.phase_name = name
        self.phase = tracing.start(f"coordinator {name}", tracing.child_of(self.span), attributes=attributes)

    def sent(self, req: Request, stamp: stage_pb2.Stamp) -> None:
        """A frame of the request is about to be sent (not for decode steps: those are per token)."""
        if self.phase_name == "queue":
            self.next_phase("prefill")
        if self.phase_name == "prefill":
            self.phase.add_event("prefill chunk", {"tether.position": stamp.position,
                                                   "tether.tokens": len(stamp.token_ids),
                                                   "tether.cached_prefix": req.cached, "tether.epoch": req.epoch})

    def finished(self, reason: int) -> None:
        """The request's last token was appended with this FinishReason."""
        self.outcome = finish_reason_name(reason)

    def event(self, name: str, reason: str, detail: str, req: Request) -> None:
        self.span.add_event(name, {"tether.reason": reason, "tether.detail": detail, "tether.epoch": req.epoch,
                                   "tether.recoveries": req.recoveries})

    def end(self, req: Request, failure: Failure | None) -> None:
        self.phase.end()
        self.span.set_attributes({"gen_ai.usage.output_tokens": len(req.seq.output_ids),
                                  "tether.rebuilds": req.retries, "tether.resumes": req.resumes})
        if self.outcome is not None:
            self.span.set_attribute("gen_ai.response.finish_reasons", [self.outcome])
        elif failure is not None:
            tracing.fail(self.span, failure.code.name, failure.message)
        else:
            self.span.set_attribute("tether.cancelled", True)
        self.span.end()
