"""tracing.py alone: when it turns on, W3C traceparent parsing (hostile peers' values ignored), and spans
exported over OTLP/gRPC to a real in-process receiver."""

from __future__ import annotations

import argparse

import pytest

from tether import telemetry
from tether.telemetry import tracing
from tests.tether.telemetry.otlp_receiver import Receiver


def test_off_unless_an_endpoint_is_configured():
    assert tracing.endpoint_from(None, {}) is None
    assert tracing.endpoint_from("http://x:4317", {}) == "http://x:4317"
    assert tracing.endpoint_from(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317"}) == "http://a:4317"
    assert tracing.endpoint_from(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317",
                                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4317"}) == "http://b:4317"
    assert tracing.endpoint_from("http://x:4317", {"OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.endpoint_from("http://x:4317", {"OTEL_TRACES_EXPORTER": "none"}) is None


def test_the_flag_is_on_every_service_parser():
    p = argparse.ArgumentParser()
    telemetry.add_flags(p)
    assert p.parse_args(["--otlp-endpoint", "http://j:4317"]).otlp_endpoint == "http://j:4317"
    assert p.parse_args([]).otlp_endpoint is None


def test_configure_without_endpoint_leaves_the_tracer_unset(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert tracing.configure("test", None) is False
    assert tracing.TRACER is None


@pytest.mark.parametrize("value", ["", "garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01",
                                   "00-" + "1" * 32 + "-" + "0" * 16 + "-01", "ff-" + "1" * 32 + "-" + "1" * 16 + "-01",
                                   "00-" + "A" * 32 + "-" + "1" * 16 + "-01"])
def test_invalid_traceparents_are_ignored(value):
    assert tracing.span_context(value) is None
    assert tracing.parent(value) is None


def test_traceparent_round_trip():
    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    c = tracing.span_context(tp)
    assert c is not None and c.is_remote and c.trace_flags.sampled
    assert f"{c.trace_id:032x}" == "ab" * 16 and f"{c.span_id:016x}" == "cd" * 8


def test_spans_reach_an_otlp_receiver(monkeypatch):
    receiver = Receiver().start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "tether-unit")
    try:
        assert tracing.configure("unit", receiver.endpoint)
        root = tracing.start("root", tracing.parent("00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"))
        child = tracing.start("child", tracing.child_of(root), attributes={"gen_ai.request.max_tokens": 5})
        child.add_event("rebuild", {"tether.reason": "DIGEST_MISMATCH"})
        child.end()
        root.end()
        assert tracing.traceparent(root).startswith("00-" + "ab" * 16 + "-")
        spans = receiver.wait_for(lambda s: len(s) >= 2, timeout=10)
        by_name = {s.name: s for s in spans}
        assert by_name["root"].parent_span_id == "cd" * 8 and by_name["root"].trace_id == "ab" * 16
        assert by_name["child"].parent_span_id == by_name["root"].span_id
        assert by_name["child"].events == [("rebuild", {"tether.reason": "DIGEST_MISMATCH"})]
        assert by_name["child"].service == "tether-unit"
    finally:
        tracing.shutdown()
        receiver.stop()
