"""W3C trace context from the SDK's caller to admission (optional): if the calling program uses OpenTelemetry
and a span is current where it calls the SDK, the call carries that span's `traceparent` gRPC metadata, so
admission's span of the request joins the caller's trace. Only the OTel API is used (no SDK, no exporter);
without OTel installed, or with no valid current span, calls carry no metadata."""

from __future__ import annotations

try:
    from opentelemetry import trace as _trace
except ImportError:   # the SDK has no hard dependency on OpenTelemetry
    _trace = None   # type: ignore[assignment]  # the SDK works without OpenTelemetry: no context to pass on


def trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """(("traceparent", ...),) for the caller's current span, or None."""
    if _trace is None:
        return None
    c = _trace.get_current_span().get_span_context()
    if not c.is_valid:
        return None
    return (("traceparent", f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"),)
