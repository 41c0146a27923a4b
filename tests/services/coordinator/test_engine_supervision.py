"""The coordinator's engine loop under supervision, against an in-process fake pipeline (labelled as such):
an unexpected error fails the active requests explicitly, frees their state, reports NOT_SERVING and the loop
comes back; a reject reason this build does not know is a rebuild, not a crash."""

from __future__ import annotations

import asyncio

import grpc

from services.coordinator.engine import Engine, Failure
from services.coordinator.scheduler import Request
from services.stage_worker.worker import echo
from tether import supervise
from tether.engine.sequence import Sequence
from tether.model.loader import load_model_tokenizer, resolve_model
from tether.protocol.hashing import hash_seed
from tether.reference import sampling_params
from tether.v1 import stage_pb2

TOK = load_model_tokenizer(resolve_model("tiny"))


class FakePipeline:
    """Stands in for services.coordinator.pipeline.Pipeline: records frames, answers with `answer(frame)`."""

    num_stages = 1
    stages: list = []
    epoch = 1

    def __init__(self, answer) -> None:
        self.answer = answer          # (connection number, slots) -> FrameReply | Exception | None
        self.seq = 0
        self.connects = 0
        self.released: list[str] = []
        self.replies_q: asyncio.Queue = asyncio.Queue()

        class _Faults:
            counts: dict = {}
        self.faults = _Faults()

    async def connect(self) -> None:
        self.connects += 1
        self.replies_q = asyncio.Queue()

    def frame_limits(self) -> tuple[int, int]:
        return 0, 0

    async def send(self, slots) -> int:
        self.seq += 1
        if slots:
            self.replies_q.put_nowait(self.answer(self.connects, self.seq, slots))
        return self.seq

    async def replies(self):
        while True:
            item = await self.replies_q.get()
            if isinstance(item, Exception):
                raise item
            if item is not None:
                yield item

    async def sync(self, ids):
        return [{}]

    async def release(self, ids) -> set[str]:
        self.released.extend(ids)
        return set()

    def close_stream(self) -> None:
        pass


def request(rid: str) -> Request:
    seq = Sequence(rid, [72, 105], sampling_params(max_tokens=4), TOK, hash_seed("fp", ""), 4096)
    return Request(seq)


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_an_unexpected_error_fails_requests_explicitly_frees_state_and_the_loop_comes_back():
    health: list[bool] = []

    async def on_serving(serving: bool) -> None:
        health.append(serving)

    def answer(conn, seq, slots):
        return RuntimeError("a peer answered outside the contract") if conn == 1 else None

    async def go():
        pipe = FakePipeline(answer)
        engine = Engine(pipe, on_serving=on_serving)
        task = supervise.start("engine", engine.run, engine.crashed, restart_s=0)
        await _until(lambda: engine.serving)
        events = engine.submit(request("r1"))
        failure = await asyncio.wait_for(events.get(), 10)
        await _until(lambda: pipe.connects == 2 and engine.serving)
        # served again: a new request is accepted and framed on the new connection
        engine.submit(request("r2"))
        await _until(lambda: pipe.seq >= 2)
        task.cancel()
        return failure, pipe, engine

    failure, pipe, engine = asyncio.run(go())
    assert isinstance(failure, Failure) and failure.code == grpc.StatusCode.INTERNAL
    assert "outside the contract" in failure.message
    assert "r1" in pipe.released                       # its stage state is released, not left to the lease
    assert health[:3] == [True, False, True]           # NOT_SERVING while the loop was down
    assert engine.counters.failed == 1


def test_an_unknown_reject_reason_is_a_rebuild_not_a_crash():
    def answer(conn, seq, slots):
        (slot,) = slots
        return stage_pb2.FrameReply(stream_seq=seq, results=[stage_pb2.SlotResult(
            stamp=echo(slot.stamp), ok=False, reason=99, detail="from a newer peer")])

    async def go():
        pipe = FakePipeline(answer)
        engine = Engine(pipe, max_rebuilds=2)
        task = supervise.start("engine", engine.run, engine.crashed, restart_s=0)
        await _until(lambda: engine.serving)
        events = engine.submit(request("r1"))
        failure = await asyncio.wait_for(events.get(), 10)
        task.cancel()
        return failure, pipe, engine

    failure, pipe, engine = asyncio.run(go())
    assert pipe.connects == 1                                     # the loop never died
    assert engine.counters.rejections["UNKNOWN_REASON_99"] == 3   # first try + 2 rebuilds
    assert failure.code == grpc.StatusCode.ABORTED and "UNKNOWN_REASON_99" in failure.message
