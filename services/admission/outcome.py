"""What happens to one request, told once to every place that records it: the metrics (refusals, latencies,
tokens, successes and failures), the access log line and the request's span.

The front door (door.py) reports each step to one `Outcome` per request, whichever face (gRPC or HTTP) the
request came by; the Outcome decides what each sink makes of it, so the admit path has no `if metrics` or
`if tracing` branches. Without --metrics-port there are no metrics to observe, and without tracing the span
is a `NoTrace`: both cost a method call that does nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from services.admission.pipelines import Routed
from services.admission.status import Rejected
from services.admission.tagger import Tags
from services.admission.validate import ValidRequest
from tether.telemetry import logs, tracing
from tether.telemetry.metrics import AdmissionMetrics, RequestTimer

if TYPE_CHECKING:
    from tether.v1 import admission_pb2

log = logging.getLogger("services.admission.server")   # the access log's logger name, as before the split


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A request past every check of admission: its internal id, the validated request and its tags."""

    internal_id: str
    valid: ValidRequest
    tags: Tags


@dataclasses.dataclass(frozen=True)
class Call:
    """What admission needs of a call, whichever face it arrived by: the method (a span's name), the caller's
    metadata or headers (lower-case keys: authorization, traceparent), the caller's deadline on the
    time.monotonic() clock (None: it set none; the maximum lifetime applies) and the face's span attributes."""

    method: str
    metadata: Sequence[tuple[str, str | bytes]]
    deadline: float | None
    attributes: Mapping[str, str]

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


class Trace(Protocol):
    traceparent: str

    def admitted(self, a: Admitted, model: str, fingerprint: str, request: "admission_pb2.GenerateRequest",
                 started_ns: int) -> None: ...
    def routed(self, routed: Routed | None, started_ns: int, error: BaseException | None = None) -> None: ...
    def finished(self, output_tokens: int, finish_reason: str) -> None: ...
    def usage(self, output_tokens: int) -> None: ...
    def resumed(self, reason: str, detail: str, pipeline: str, tokens: int) -> None: ...
    def end(self, error: BaseException | None) -> None: ...


class NoTrace:
    """The span of a request while tracing is off: nothing recorded, nothing propagated."""

    traceparent = ""

    def admitted(self, *args: object) -> None: pass
    def routed(self, *args: object) -> None: pass
    def finished(self, *args: object) -> None: pass
    def usage(self, *args: object) -> None: pass
    def resumed(self, *args: object) -> None: pass
    def end(self, *args: object) -> None: pass


class RequestTrace:
    """Admission's span of one request (built only while tracing is on): a SERVER span, child of the caller's
    `traceparent` metadata if any, with children for validate+tag and route; its traceparent goes to the
    coordinator in the SubmitRequest. Attributes: GenAI semantic conventions (gen_ai.*) and the intent tags
    and routing decision as tether.*. Every log line of the handler's task carries its trace id."""

    def __init__(self, call: Call) -> None:
        caller = tracing.metadata_traceparent(call.metadata)
        self.span = tracing.start(f"admission {call.method}", tracing.parent(caller), tracing.SpanKind.SERVER,
                                  dict(call.attributes))
        # Propagate only a recording span's context: an unsampled request costs the stages nothing.
        self.traceparent = tracing.traceparent(self.span) if self.span.is_recording() else ""
        logs.TRACE_ID.set(tracing.trace_id(self.span) if self.traceparent else None)   # this task's lines

    def _child(self, name: str, started_ns: int, attributes: dict) -> tracing.Span:
        assert tracing.TRACER is not None   # a request's spans exist only with tracing on
        return tracing.TRACER.start_span(name, context=tracing.child_of(self.span), attributes=attributes,
                                         start_time=started_ns)

    def admitted(self, a: Admitted, model: str, fingerprint: str, request: "admission_pb2.GenerateRequest",
                 started_ns: int) -> None:
        valid, tags = a.valid, a.tags
        attributes = {f"tether.{k}": v for k, v in dataclasses.asdict(tags).items()}
        attributes["tether.prefix_key"] = f"{tags.prefix_key:016x}"   # a uint64: not an OTel int64 attribute
        attributes.update({
            "gen_ai.operation.name": "chat" if request.messages else "text_completion",
            "gen_ai.system": "tether",
            "gen_ai.request.model": model,
            "tether.model_fingerprint": fingerprint,
            "gen_ai.request.max_tokens": tags.output_budget,
            "gen_ai.request.temperature": valid.sampling.temperature,
            "gen_ai.usage.input_tokens": len(valid.prompt_token_ids),
            "tether.request_id": a.internal_id,
        })
        if valid.sampling.top_p:
            attributes["gen_ai.request.top_p"] = valid.sampling.top_p
        if 0 < valid.sampling.seed < 2**63:   # OTel ints are int64; the seed is a uint64
            attributes["gen_ai.request.seed"] = valid.sampling.seed
        if valid.request_id:
            attributes["tether.label"] = valid.request_id
        self.span.set_attributes(attributes)
        self._child("admission validate+tag", started_ns,
                    {"tether.input_tokens": tags.input_tokens, "tether.language": tags.language,
                     "tether.task": tags.task, "tether.size_class": tags.size_class}).end()

    def routed(self, routed: Routed | None, started_ns: int, error: BaseException | None = None) -> None:
        attributes = {}
        if routed is not None:
            attributes = {"tether.pipeline": routed.link.name, "tether.pipeline_address": routed.link.address,
                          "tether.route_reason": routed.reason}   # the trace is the operator's: the address too
            self.span.set_attributes(attributes)
        span = self._child("admission route", started_ns, attributes)
        if error is not None:
            _fail_span(span, error)
        span.end()

    def finished(self, output_tokens: int, finish_reason: str) -> None:
        self.span.set_attributes({"gen_ai.usage.output_tokens": output_tokens,
                                  "gen_ai.response.finish_reasons": [finish_reason]})

    def usage(self, output_tokens: int) -> None:
        self.span.set_attribute("gen_ai.usage.output_tokens", output_tokens)

    def resumed(self, reason: str, detail: str, pipeline: str, tokens: int) -> None:
        """A hop: the pipeline dropped the request and it continues on `pipeline` after `tokens` outputs."""
        self.span.add_event("resume", {"tether.reason": reason, "tether.detail": detail,
                                       "tether.pipeline": pipeline, "tether.resume_tokens": tokens})

    def end(self, error: BaseException | None) -> None:
        if error is not None:
            _fail_span(self.span, error)
        self.span.end()


def _fail_span(span: tracing.Span, error: BaseException) -> None:
    """A span ended by a refusal or failure (its status code and message), a cancellation or a bug."""
    if isinstance(error, Rejected):
        tracing.fail(span, error.code.name, error.message)
    elif isinstance(error, asyncio.CancelledError):
        tracing.fail(span, "CANCELLED", "the call was cancelled (client gone or deadline)")
    else:
        tracing.fail(span, type(error).__name__, str(error))


class Outcome:
    """One request's reports: refused before reaching a coordinator (a `requests_shed` reason), or started
    there, its tokens, and how it ended (finished with a reason, or failed with a code), plus its span."""

    def __init__(self, metrics: AdmissionMetrics | None, call: Call | None = None) -> None:
        self.metrics = metrics
        self.trace: Trace = RequestTrace(call) if call is not None and tracing.TRACER is not None else NoTrace()
        self.timer: RequestTimer | None = None
        self.tokens = 0   # the request's output tokens so far (a resume's included): the next event's index

    @property
    def traceparent(self) -> str:
        return self.trace.traceparent

    def refused(self, reason: str) -> None:
        """Refused before the coordinator (the caller gets the Rejected that goes with it)."""
        if self.metrics is not None:
            self.metrics.shed.labels(reason).inc()

    def auth_failed(self, reason: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.auth_failures.labels(reason).inc()
        log.debug("refused a call (%s): %s", reason, message)   # the message never holds the key

    def admitted(self, a: Admitted, model: str, fingerprint: str, request: "admission_pb2.GenerateRequest",
                 started_ns: int) -> None:
        self.trace.admitted(a, model, fingerprint, request, started_ns)

    def routed(self, routed: Routed | None, started_ns: int, error: BaseException | None = None) -> None:
        self.trace.routed(routed, started_ns, error)

    def started(self, tenant: str, prompt_tokens: int, arrived: float, resumed: int = 0) -> None:
        """Sent to a coordinator. `arrived`: time.perf_counter() when the call reached admission; `resumed`:
        output tokens an earlier attempt already produced (a resumed request's events start after them)."""
        self.tokens = resumed
        if self.metrics is not None:
            self.timer = self.metrics.start(tenant, prompt_tokens, arrived)

    def token(self) -> None:
        self.tokens += 1
        if self.timer is not None:
            self.timer.token(time.perf_counter())

    def finished(self, finish_reason: str) -> None:
        self.trace.finished(self.tokens, finish_reason)
        if self.timer is not None:
            self.timer.finished(finish_reason, time.perf_counter())

    def failed(self, code_name: str) -> None:
        """Ended by a status after it started (CANCELLED: the caller went away)."""
        if self.timer is not None:
            self.timer.failed(code_name)
        self.trace.usage(self.tokens)

    def resumed(self, reason: str, detail: str, pipeline: str) -> None:
        """The request continues on another pipeline (`reason`: how the last one dropped it)."""
        if self.metrics is not None:
            self.metrics.resumed.labels(reason).inc()
        self.trace.resumed(reason, detail, pipeline, self.tokens)
        log.info("request continues on %s after %d token(s): %s (%s)", pipeline, self.tokens, reason, detail)

    def ended(self, request_id: str, how: str) -> None:
        # One line per request at DEBUG (free at INFO): with --log-format json, an access log keyed by id.
        log.debug("request %s ended: %s after %d token(s)", request_id, how, self.tokens)

    def close(self, error: BaseException | None) -> None:
        """The call is over (answered, refused, failed or cancelled): end its span."""
        self.trace.end(error)
