"""Tracing: OpenTelemetry spans exported over OTLP/gRPC (what Jaeger receives on 4317), one trace per request.

Off unless configured: `--otlp-endpoint URL` or the standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variable.
Then the standard variables apply as the OpenTelemetry SDK reads them: OTEL_SERVICE_NAME (default
tether-<service>), OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default
parentbased_always_on), OTEL_BSP_* (the batch span processor); OTEL_SDK_DISABLED=true or
OTEL_TRACES_EXPORTER=none turn it off whatever the endpoint.

While off, `TRACER` is None and the services check that one global before building anything: no span, no
context, no attribute dict is made, and the per-slot `traceparent` of a frame stays an empty string.

How a request's context travels (docs/PROTOCOL.md "Tracing"): the caller's W3C `traceparent` gRPC metadata
into admission; admission -> coordinator in SubmitRequest.traceparent (the Session stream is shared by many
requests, so its metadata cannot carry one request's context); coordinator -> stages in Slot.traceparent, per
slot, since one frame carries many requests.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

TRACER: trace.Tracer | None = None      # set by configure(); None: tracing off (the one check on every path)
_PROVIDER = None                        # the SDK TracerProvider, for shutdown()
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--otlp-endpoint: the same on every service (called by tether.telemetry.add_flags)."""
    parser.add_argument("--otlp-endpoint", default=None, metavar="URL",
                        help="export OpenTelemetry traces over OTLP/gRPC to URL (e.g. http://jaeger:4317; "
                             "https:// for TLS); default: the OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
                             "OTEL_EXPORTER_OTLP_ENDPOINT variable, and without either tracing is off. The other "
                             "OTEL_* variables apply: OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, "
                             "OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_SCHEDULE_DELAY")


def endpoint_from(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where traces go, or None for off: the flag, else the standard variables (traces-specific first)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    return (flag or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def configure(service: str, endpoint: str | None) -> bool:
    """Turn tracing on for this process when an endpoint is configured (the flag's value or None); returns
    whether it is on. The SDK is imported only then: a service without tracing does not load it."""
    global TRACER, _PROVIDER
    url = endpoint_from(endpoint)
    if url is None:
        TRACER = None
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME over this default name.
    resource = Resource.create({"service.name": f"tether-{service}"})
    provider = TracerProvider(resource=resource)   # sampler from OTEL_TRACES_SAMPLER(_ARG)
    insecure = not url.startswith("https://")
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, insecure=insecure)))
    _PROVIDER = provider
    TRACER = provider.get_tracer("tether")
    log.info("tracing on: OTLP/gRPC to %s as %s", url, resource.attributes.get("service.name"))
    return True


def shutdown() -> None:
    """Export what is buffered and stop (also done at interpreter exit by the SDK)."""
    global TRACER, _PROVIDER
    if _PROVIDER is not None:
        _PROVIDER.shutdown()
    TRACER, _PROVIDER = None, None


# ---- W3C trace context ------------------------------------------------------------------------------------

def traceparent(span: Span) -> str:
    """The W3C traceparent of a span ("" for an invalid one): what travels in SubmitRequest and Slot."""
    c = span.get_span_context()
    if not c.is_valid:
        return ""
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def span_context(value: str) -> SpanContext | None:
    """Parse a W3C traceparent (from a peer: anything that does not parse is ignored, never an error)."""
    m = _TRACEPARENT.match(value)
    if m is None or m.group(1) == "ff":
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(int(m.group(4), 16)))


def parent(value: str | None):
    """An OTel Context with the remote parent of `value` (a traceparent), or None (a new trace)."""
    if not value:
        return None
    c = span_context(value)
    return trace.set_span_in_context(trace.NonRecordingSpan(c)) if c is not None else None


def child_of(span: Span):
    """An OTel Context whose current span is `span`: for starting children explicitly (no global context is
    attached: a request's work hops between tasks and threads)."""
    return trace.set_span_in_context(span)


def trace_id(span: Span) -> str | None:
    """The 32-hex trace id of a span, for the JSON logs' trace_id field."""
    c = span.get_span_context()
    return f"{c.trace_id:032x}" if c.is_valid else None


def start(name: str, parent_context=None, kind: SpanKind = SpanKind.INTERNAL,
          attributes: Attributes = None, links: Sequence[Link] | None = None) -> Span:
    """Start a span with the configured tracer (call only when TRACER is not None)."""
    assert TRACER is not None
    return TRACER.start_span(name, context=parent_context, kind=kind, attributes=attributes, links=links)


def fail(span: Span, code_name: str, message: str) -> None:
    """Mark a span failed with a gRPC status (its name as `rpc.grpc.status_code`'s text)."""
    span.set_attribute("tether.status", code_name)
    span.set_status(Status(StatusCode.ERROR, f"{code_name}: {message}"))


def metadata_traceparent(metadata) -> str | None:
    """The caller's `traceparent` from gRPC invocation metadata (None without one)."""
    for key, value in metadata or ():
        if key == "traceparent":
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


__all__ = ["TRACER", "Link", "Span", "SpanKind", "add_flags", "child_of", "configure", "endpoint_from", "fail",
           "metadata_traceparent", "parent", "shutdown", "span_context", "start", "trace_id", "traceparent"]
