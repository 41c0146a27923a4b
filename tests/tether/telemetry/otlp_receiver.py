"""A real OTLP/gRPC trace receiver in-process (the collector's TraceService, as Jaeger listens on 4317): the
tests point services at it and read back every span exported to it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    service: str                       # resource service.name
    name: str
    trace_id: str                      # 32 hex
    span_id: str                       # 16 hex
    parent_span_id: str                # "" for a root span
    kind: int
    attributes: dict
    events: list[tuple[str, dict]]
    links: list[tuple[str, str]]       # (trace id, span id), hex
    status_code: int
    start_ns: int
    end_ns: int
    resource: dict = field(default_factory=dict)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Start with `start()`; `endpoint` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Receiver":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None)

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        service=str(resource.get("service.name", "")), name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                        attributes=_attrs(s.attributes), events=[(e.name, _attrs(e.attributes)) for e in s.events],
                        links=[(l.trace_id.hex(), l.span_id.hex()) for l in s.links], status_code=s.status.code,
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano, resource=resource))
        with self.lock:
            self.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, ready: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0,
                 what: str = "spans") -> list[ReceivedSpan]:
        """Poll until `ready(spans)` holds; fail with what was received once `timeout` has passed."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if ready(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"no {what} after {timeout:g} s; received {len(spans)} span(s): {names}")
            time.sleep(0.05)
