"""A stage's spans (StageTraces) on real frames through a 2-stage split of the tiny model, no gRPC: each traced
slot's request span is a child of its traceparent, the step span links to it, and a traceparent, valid, forged
or absent, changes neither the frame's digest nor any result."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.stage_worker.worker import StageTraces, StageWorker, frame_digest
from tether import reference, settings
from tether.model.loader import load_slice, resolve_model
from tether.protocol.hashing import context_hash, hash_seed, sampling_digest
from tether.telemetry import tracing
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

KEY = StampKey(bytes(range(32)))   # the pipeline's stamp key, as a handshake would set it

TRACE = "ab" * 16
PARENT = "cd" * 8


@pytest.fixture(scope="module")
def slices():
    folder = resolve_model("tiny")
    return load_slice(folder, 0, 2, settings.DTYPE), load_slice(folder, 2, 4, settings.DTYPE)   # as the reference


@pytest.fixture
def exported(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "TRACER", provider.get_tracer("test"))
    return exporter


def _frame(traceparents: dict[str, str]) -> stage_pb2.Frame:
    seed = hash_seed(reference.load("tiny").fingerprint, "")
    params = reference.sampling_params(max_tokens=4)
    slots = []
    for k, rid in enumerate(("a", "b", "c")):
        ids = [10 + k, 20, 30 + k]
        stamp = stage_pb2.Stamp(request_id=rid, epoch=1, position=0, token_ids=ids, parent_hash=context_hash(seed, []),
                                context_hash=context_hash(seed, ids), sampling_digest=sampling_digest(params))
        slots.append(stage_pb2.Slot(stamp=stamp, sampling=params, sample=True, hash_seed=seed,
                                    traceparent=traceparents.get(rid, "")))
    frame = stage_pb2.Frame(stream_seq=1, pipeline_epoch=1, slots=slots)
    KEY.seal(frame)
    return frame


def _run(first, second, frame) -> list[tuple]:
    out0 = first.process(frame)
    out1 = second.process(out0.forward)
    return [(r.stamp.request_id, r.ok, r.token_id, r.token_hash) for r in [*out0.results, *out1.results]]


def test_traced_slots_get_child_spans_linked_from_the_step_and_answers_do_not_change(slices, exported):
    traced = {"a": f"00-{TRACE}-{PARENT}-01", "b": "00-forged-by-a-peer-01"}   # c: not traced
    plain = _frame({})
    with_context = _frame(traced)
    assert frame_digest(plain, KEY) == frame_digest(with_context, KEY)   # the traceparent is not bound by the digest

    expected = _run(StageWorker(slices[0], 0, 100_000, stamp_key=KEY), StageWorker(slices[1], 1, 100_000, stamp_key=KEY), plain)
    w0, w1 = StageWorker(slices[0], 0, 100_000, stamp_key=KEY), StageWorker(slices[1], 1, 100_000, stamp_key=KEY)
    t0, t1 = StageTraces(w0), StageTraces(w1)
    assert _run(t0, t1, with_context) == expected
    assert all(ok for _, ok, _, _ in expected)

    assert set(t0.open) == set(t1.open) == {"a"}   # the forged value is ignored, never an error
    t0.released(["a", "b", "c"], "release")
    t1.released(["a"], "release")
    spans = {s.name: s for s in exported.get_finished_spans()}
    for i in (0, 1):
        request, step = spans[f"stage{i} request"], spans[f"stage{i} step"]
        assert f"{request.context.trace_id:032x}" == TRACE and f"{request.parent.span_id:016x}" == PARENT
        assert request.attributes["tether.stage_index"] == i and request.attributes["tether.steps"] == 1
        assert request.attributes["tether.rows"] == 3 and request.attributes["tether.ended_by"] == "release"
        assert step.parent is None and [link.context.span_id for link in step.links] == [request.context.span_id]
        assert step.attributes["tether.slots"] == 3 and step.attributes["tether.traced_slots"] == 1


def test_a_rejected_traced_slot_is_an_event_with_its_reason(slices, exported):
    frame = _frame({"a": f"00-{TRACE}-{PARENT}-01"})
    frame.slots[0].stamp.position = 5   # no state held, yet not at position 0: the stage refuses the slot
    KEY.seal(frame)
    traces = StageTraces(StageWorker(slices[0], 0, 100_000, stamp_key=KEY))
    out = traces.process(frame)
    (rejected,) = [r for r in out.results if r.stamp.request_id == "a"]
    assert not rejected.ok
    traces.released(["a"], "release")
    request = next(s for s in exported.get_finished_spans() if s.name == "stage0 request")
    (event,) = request.events
    assert event.name == "rejection" and event.attributes["tether.position"] == 5
    assert event.attributes["tether.reason"] == stage_pb2.RejectReason.Name(rejected.reason)
    assert request.attributes["tether.steps"] == 0
    step = next(s for s in exported.get_finished_spans() if s.name == "stage0 step")
    assert step.attributes["tether.rejected_slots"] == 1
