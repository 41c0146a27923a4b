"""The handshake refusals a stage gives, one rule at a time (no processes: the rule is pure)."""

from __future__ import annotations

import dataclasses

import pytest

from services.stage_worker.server import StageServicer
from services.stage_worker.worker import StageWorker
from tether import settings
from tether.model.loader import load_slice, model_fingerprint, resolve_model
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

KEY = StampKey(bytes(range(32)))   # the pipeline's stamp key, as a handshake would set it


@pytest.fixture(scope="module")
def folder():
    return resolve_model("tiny")


def servicer(folder, start: int, end: int) -> StageServicer:
    worker = StageWorker(load_slice(folder, start, end, "float32"), 0, 1024, stamp_key=KEY)
    return StageServicer(worker, model_fingerprint(folder), "127.0.0.1:1")


def request(folder, index: int, stages: int, prev_end: int, **over) -> stage_pb2.HandshakeRequest:
    req = stage_pb2.HandshakeRequest(protocol_version=settings.PROTOCOL_VERSION,
                                     model_fingerprint=model_fingerprint(folder),
                                     route=[stage_pb2.RouteEntry(address=f"127.0.0.1:{i + 1}") for i in range(stages)],
                                     index=index, prev_layer_end=prev_end, pipeline_epoch=7, dtype="float32",
                                     stamp_key=KEY.key)
    for k, v in over.items():
        setattr(req, k, v)
    return req


def test_a_matching_stage_accepts(folder):
    assert servicer(folder, 2, 4)._refusal(request(folder, 1, 2, 2)) is None
    assert servicer(folder, 2, 4)._refusal(request(folder, 1, 2, 2, dtype="")) is None   # coordinator --dtype auto


@pytest.mark.parametrize("start,end,index,stages,prev,over,words", [
    (2, 4, 1, 2, 2, {"protocol_version": settings.PROTOCOL_VERSION + 1}, "protocol"),
    (2, 4, 1, 2, 2, {"model_fingerprint": "0123456789abcdef"}, "expects 0123456789abcdef"),
    (2, 4, 1, 2, 2, {"dtype": "bfloat16"}, "the stages before it run bfloat16: a pipeline never mixes numerics"),
    (0, 4, 0, 1, 0, {"dtype": "bfloat16"}, "the coordinator expects bfloat16"),
    (3, 4, 1, 2, 2, {}, "gap"),
    (1, 4, 1, 2, 2, {}, "overlap"),
    (2, 3, 1, 2, 2, {}, "lacks the head"),
    (0, 4, 0, 2, 0, {}, "follow it"),
    (2, 4, 5, 2, 2, {}, "not in the route"),
    (2, 4, 1, 2, 2, {"stamp_key": b""}, "32-byte stamp key, got 0 bytes"),
    (2, 4, 1, 2, 2, {"stamp_key": bytes(31)}, "got 31 bytes"),
    (2, 4, 1, 2, 2, {"stamp_key": bytes(33)}, "got 33 bytes"),
])
def test_each_refusal_names_the_stage_and_the_reason(folder, start, end, index, stages, prev, over, words):
    why = servicer(folder, start, end)._refusal(request(folder, index, stages, prev, **over))
    assert why is not None and words in why and f"stage {index}" in why


@pytest.mark.parametrize("threads,alone,cap,want", [(1, 2, None, (1, 2)), (1, 0, None, (1, 1)), (2, 2, None, (2, 2)),
                                                    (1, 4, 2, (1, 2)), (2, 2, 1, (1, 1))])
def test_the_stage_info_says_the_threads_a_step_takes_under_load_and_alone(folder, threads, alone, cap, want):
    """What the coordinator reads to keep one micro-batch in flight while few requests are active (only where
    alone_threads > threads on every stage): --threads and --alone-threads (0: as under load), within the
    rule's thread cap (a Xeon caps smollm2 at 1: alone would then gain nothing)."""
    svc = servicer(folder, 0, 2)
    worker = svc.worker
    worker.threads, worker.alone_threads = threads, alone
    worker.model.rows = dataclasses.replace(worker.model.rows, threads=cap)
    info = svc.info()
    assert (info.threads, info.alone_threads) == want
    assert svc.info(disclose=False).alone_threads == want[1]
