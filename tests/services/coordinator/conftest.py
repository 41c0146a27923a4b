"""Shared pieces of the coordinator tests: an in-process stand-in for the pipeline (labelled as a fake)."""

from __future__ import annotations

import asyncio

import pytest

from services.coordinator.scheduler import Request
from tether import settings
from tether.generation.sequence import Sequence
from tether.model.loader import load_model_tokenizer, resolve_model
from tether.protocol.hashing import hash_seed
from tether.protocol.stamp_key import StampKey
from tether.reference import sampling_params
from tether.v1 import stage_pb2

TOK = load_model_tokenizer(resolve_model("tiny"))


class FakePipeline:
    """Stands in for services.coordinator.pipeline.Pipeline: records frames, answers with `answer(frame)`."""

    num_stages = 1
    # what a one-stage handshake reports: a paged pool in blocks, so large the ledger never runs out of it
    stages = [stage_pb2.StageInfo(kv_block_tokens=settings.ATTENTION_BLOCK, kv_capacity_tokens=1 << 40)]
    epoch = 1
    stamp_key = StampKey(bytes(range(32)))   # what a handshake would have agreed with the (fake) stages

    def __init__(self, answer) -> None:
        self.answer = answer          # (connection number, slots) -> FrameReply | Exception | None
        self.stream_seq = 0
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

    def frame(self, slots) -> stage_pb2.Frame:
        self.stream_seq += 1
        return stage_pb2.Frame(stream_seq=self.stream_seq, slots=slots)

    async def send(self, frame: stage_pb2.Frame) -> None:
        if frame.slots:
            self.replies_q.put_nowait(self.answer(self.connects, frame.stream_seq, list(frame.slots)))

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


def request(rid: str, max_tokens: int = 4) -> Request:
    seq = Sequence(rid, [72, 105], sampling_params(max_tokens=max_tokens), TOK, hash_seed("fp", ""), 4096)
    return Request(seq)


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)



async def _run_one(pipe: FakePipeline, req: Request, **driver_args) -> tuple[list, object]:
    """Run a Driver over `pipe` until `req` ends (a Failure or its last token): its events and the counters."""
    from services.coordinator.driver import Driver, Failure
    from tether import supervise
    driver = Driver(pipe, **driver_args)
    task = supervise.start("driver", driver.run, driver.crashed, restart_s=0)
    try:
        await _until(lambda: driver.serving)
        events = driver.submit(req)
        out = []
        while True:
            ev = await asyncio.wait_for(events.get(), 30)
            out.append(ev)
            if isinstance(ev, Failure) or ev.finish_reason:
                return out, driver.counters
    finally:
        task.cancel()


@pytest.fixture
def kit():
    """The helpers above, for test modules (no imports between test files)."""
    class Kit:
        pass
    k = Kit()
    k.FakePipeline, k.request, k.until, k.run_one = FakePipeline, request, _until, _run_one
    return k
