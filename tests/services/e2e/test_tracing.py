"""Tracing end to end: a real OTLP/gRPC trace receiver in this process (the collector's TraceService, as Jaeger
listens on 4317) and a 2-stage cluster exporting to it. One request's trace holds admission's, the
coordinator's and both stages' spans, parented through the W3C traceparent that travels in the SubmitRequest
and in each frame's slots, with the shared step spans linked to each request; a rebuilt request shows the
rebuild event with its reason; the JSON logs carry the trace id of the request they are about."""

from __future__ import annotations

import json
import os

import grpc
import pytest

from tether.cli.cluster import LocalCluster
from tether.client import Client
from tether.v1 import admission_pb2, admission_pb2_grpc
from tests.tether.telemetry.otlp_receiver import Receiver, ReceivedSpan

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver():
    r = Receiver().start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def cluster(receiver, tmp_path_factory):
    """Tracing on through the standard variables (children inherit the environment). Every stage corrupts a
    fraction of what it sends, so some requests are rebuilt; the budget is large enough that none fails."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100",
           "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    json_logs = ["--log-format", "json"]
    c = LocalCluster(model="tiny", stages=2, threads=1, log_dir=tmp_path_factory.mktemp("logs"),
                     extra={"stage": ["--faults", "corrupt=0.15,seed=3", *json_logs],
                            "coordinator": ["--max-rebuilds", "64", *json_logs], "admission": json_logs})
    try:
        c.start(timeout=180)
    finally:   # the children have their environment: this process's tests must not inherit it
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield c
    finally:
        c.stop()


def _trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} span(s) named {name!r} in {sorted(s.name for s in spans)}"
    return found[0]


def _complete(trace_id: str):
    """Admission's, the coordinator's and both stages' request spans of the trace have arrived (the stages' end
    at the Release that follows the last token)."""
    want = {"admission Generate", "coordinator request", "stage0 request", "stage1 request"}
    return lambda spans: want <= {s.name for s in _trace(spans, trace_id)}


def test_one_request_is_one_trace_across_every_service(cluster, receiver):
    # The caller's own W3C context, as gRPC metadata: admission's span continues the caller's trace.
    with grpc.insecure_channel(cluster.target) as ch:
        reply = admission_pb2_grpc.AdmissionStub(ch).Generate(
            admission_pb2.GenerateRequest(prompt=b"Summarize this in 10 words: the cat sat on the mat",
                                          sampling={"max_tokens": 6, "temperature": 0.5, "seed": 11},
                                          tenant="acme", request_id="traced-1"),
            metadata=(("traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"),), timeout=60)
    rid = reply.receipt.internal_id
    spans = _trace(receiver.wait_for(_complete(CALLER_TRACE), what=f"complete trace of {rid}"), CALLER_TRACE)

    adm = _one(spans, "admission Generate")
    assert adm.service == "tether-admission" and adm.parent_span_id == CALLER_SPAN
    a = adm.attributes
    assert a["tether.request_id"] == rid and a["tether.label"] == "traced-1" and a["tether.tenant"] == "acme"
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.usage.input_tokens"] == reply.receipt.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == reply.receipt.output_tokens == len(reply.token_ids)
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["gen_ai.request.model"] == "tiny"
    # the intent tags, as the response carries them
    assert a["tether.task"] == reply.tags.task == "summarize" and a["tether.language"] == reply.tags.language
    assert a["tether.length_limit"] == reply.tags.length_limit == 10
    assert a["tether.pipeline"] == reply.tags.pipeline and a["tether.route_reason"] == reply.tags.route_reason
    assert _one(spans, "admission validate+tag").parent_span_id == adm.span_id
    route = _one(spans, "admission route")
    assert route.parent_span_id == adm.span_id and route.attributes["tether.pipeline"] == reply.tags.pipeline

    coord = _one(spans, "coordinator request")
    assert coord.service == "tether-coordinator" and coord.parent_span_id == adm.span_id
    assert coord.attributes["tether.request_id"] == rid
    assert coord.attributes["gen_ai.usage.output_tokens"] == len(reply.token_ids)
    for phase in ("coordinator queue", "coordinator prefill", "coordinator decode"):
        assert _one(spans, phase).parent_span_id == coord.span_id
    assert any(name == "prefill chunk" for name, _ in _one(spans, "coordinator prefill").events)

    for i in (0, 1):
        stage = _one(spans, f"stage{i} request")
        assert stage.service == "tether-stage" and stage.parent_span_id == coord.span_id
        assert stage.attributes["tether.stage_index"] == i and stage.attributes["tether.request_id"] == rid
        assert stage.attributes["tether.steps"] >= len(reply.token_ids)
        # the shared steps this request took part in link to its span on the stage
        steps = receiver.wait_for(lambda all_, stage=stage, i=i: any((CALLER_TRACE, stage.span_id) in s.links
                                                                     for s in all_ if s.name == f"stage{i} step"),
                                  what=f"stage{i} step links")
        linked = [s for s in steps if s.name == f"stage{i} step" and (CALLER_TRACE, stage.span_id) in s.links]
        assert len(linked) >= len(reply.token_ids) and all(s.parent_span_id == "" for s in linked)


def test_a_rebuilt_request_shows_the_rebuild_with_its_reason(cluster, receiver):
    rebuilt: ReceivedSpan | None = None
    with Client(cluster.target, timeout=60, retry=None) as client:
        for k in range(40):   # corrupt=0.15 on both stages: a request of 8 tokens is rebuilt most of the time
            r = client.generate(f"request {k} that may be rebuilt", max_tokens=8, request_id=f"rebuild-{k}")
            spans = receiver.wait_for(lambda s, r=r: any(x.name == "coordinator request" and
                                                    x.attributes.get("tether.request_id") == r.receipt.internal_id
                                                    for x in s), what=f"coordinator span of {r.receipt.internal_id}")
            coord = next(x for x in spans if x.name == "coordinator request"
                         and x.attributes["tether.request_id"] == r.receipt.internal_id)
            if coord.attributes["tether.rebuilds"] > 0:
                rebuilt = coord
                break
    assert rebuilt is not None, "no request was rebuilt under corrupt=0.15 in 40 requests"
    events = [(name, attrs) for name, attrs in rebuilt.events if name == "rebuild"]
    assert len(events) == rebuilt.attributes["tether.rebuilds"]
    reasons = {attrs["tether.reason"] for _, attrs in events}
    # a corrupted frame or token is caught by a stamp check: the reason names which one
    assert reasons <= {"DIGEST_MISMATCH", "ECHO_MISMATCH", "TOKEN_HASH_MISMATCH", "STATE_MISMATCH", "BAD_TENSOR",
                       "KV_TAG_MISMATCH", "POSITION_GAP", "BAD_FRAME", "UNKNOWN_REQUEST", "STALE_EPOCH",
                       "BAD_SEQUENCE", "FRAME_LOST", "STATE_LOST"}, reasons
    assert all(attrs["tether.detail"] and attrs["tether.epoch"] > 1 for _, attrs in events)
    assert rebuilt.attributes["gen_ai.response.finish_reasons"] == ["length"]

    # The coordinator's JSON log line about that rebuild carries the request's trace id (set through `extra`).
    lines = [json.loads(line) for line in cluster.service("coordinator").log_path.read_text().splitlines()
             if line.startswith("{")]
    about = [line for line in lines if line.get("request_id") == rebuilt.attributes["tether.request_id"]
             and any(reason in line["message"] for reason in reasons)]
    assert about and all(line.get("trace_id") == rebuilt.trace_id for line in about), about


def test_an_untraced_caller_gets_a_new_trace_and_the_stages_see_it(cluster, receiver):
    with Client(cluster.target, timeout=60, retry=None) as client:
        r = client.generate("a new trace", max_tokens=3)
    spans = receiver.wait_for(lambda s: any(x.name == "admission Generate" and
                                            x.attributes.get("tether.request_id") == r.receipt.internal_id
                                            for x in s), what="admission span")
    adm = next(x for x in spans if x.name == "admission Generate"
               and x.attributes["tether.request_id"] == r.receipt.internal_id)
    assert adm.parent_span_id == ""
    receiver.wait_for(_complete(adm.trace_id), what="complete trace")


def test_the_sdk_continues_its_callers_current_span(cluster, receiver):
    from opentelemetry.sdk.trace import TracerProvider
    caller = TracerProvider().get_tracer("caller")   # not exported: only its context matters here
    with caller.start_as_current_span("the caller's work") as span, \
            Client(cluster.target, timeout=60, retry=None) as client:
        client.generate("inside the caller's span", max_tokens=2)
        ctx = span.get_span_context()
    trace_id, span_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
    spans = receiver.wait_for(lambda s: any(x.trace_id == trace_id and x.name == "admission Generate" for x in s),
                              what="admission span in the caller's trace")
    assert _one(_trace(spans, trace_id), "admission Generate").parent_span_id == span_id


def test_a_refused_request_is_a_failed_admission_span_with_its_status(cluster, receiver):
    trace_id = "5" * 32
    with grpc.insecure_channel(cluster.target) as ch, pytest.raises(grpc.RpcError) as refused:
        admission_pb2_grpc.AdmissionStub(ch).Generate(
            admission_pb2.GenerateRequest(prompt=b"x", sampling={"temperature": -1.0}),
            metadata=(("traceparent", f"00-{trace_id}-{'6' * 16}-01"),), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = receiver.wait_for(lambda s: any(x.trace_id == trace_id for x in s), what="the refused request's span")
    adm = _one(_trace(spans, trace_id), "admission Generate")
    assert adm.status_code == 2 and adm.attributes["tether.status"] == "INVALID_ARGUMENT"   # STATUS_CODE_ERROR
    assert {s.name for s in _trace(spans, trace_id)} == {"admission Generate"}   # nothing went downstream
