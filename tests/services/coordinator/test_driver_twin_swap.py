"""Issue 23 end to end in one process: the coordinator's Driver over two real StageWorkers (a 2-stage split of the
tiny model), with the twin frame made on purpose. Twins A and B (same tenant, prompt and sampling) decode in
step; stage 1 forgets A (A is rebuilt), then forgets B while A replays (B is rebuilt), so in the next frame A
decodes one token at position p while B replays p+1 tokens from 0: the same context end, different starts.
Their stamps are swapped on the way to stage 1 (the `swap_slots` fault: stamps move, rows stay). Both twins must
end exactly as tether.reference generates them alone: the swap is refused (DIGEST_MISMATCH) and rebuilt, never
sampled from shifted rows."""

from __future__ import annotations

import asyncio

import pytest

from services.coordinator.driver import Driver, Failure
from services.coordinator.scheduler import Request
from tether import reference, settings, supervise
from tether.generation.sequence import Sequence
from tether.model.loader import load_model_tokenizer, load_slice, resolve_model
from tether.protocol.hashing import hash_seed
from tether.v1 import stage_pb2

PROMPT = [72, 105]   # greedy on tiny: 12, 131, 131, 70, 70, 87, 9, 12 (tokens that vary: a shift shows)
PARAMS = reference.sampling_params(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def slices():
    folder = resolve_model("tiny")
    return load_slice(folder, 0, 2, settings.DTYPE), load_slice(folder, 2, 4, settings.DTYPE)   # as the reference


def stages_pipeline(kit, slices):
    """FakePipeline (tests/services/coordinator/conftest.py) made real: frames signed and digested as
    services.coordinator.pipeline.Pipeline.frame does, run through stage 0 and stage 1 in process, with
    `TwinSwap.between` on what stage 0 forwards."""
    from services.stage_worker.worker import StageWorker

    class StagesPipeline(kit.FakePipeline):
        num_stages = 1   # one micro-batch in flight: the twins share every frame

        def __init__(self) -> None:
            super().__init__(None)
            self.w = [StageWorker(s, i, 4096, stamp_key=self.stamp_key) for i, s in enumerate(slices)]
            self.between = lambda forward: None

        def frame(self, slots):
            self.stream_seq += 1
            self.stamp_key.sign(slots)
            return stage_pb2.Frame(stream_seq=self.stream_seq, pipeline_epoch=self.epoch, slots=slots,
                                   payload_digest=self.stamp_key.frame_digest(b"", slots))

        async def send(self, frame: stage_pb2.Frame) -> None:
            if not frame.slots:
                return
            out0 = self.w[0].process(frame)
            results = list(out0.results)
            if out0.forward is not None:
                self.between(out0.forward)
                results += self.w[1].process(out0.forward).results
            self.replies_q.put_nowait(stage_pb2.FrameReply(stream_seq=frame.stream_seq, results=results))

        async def sync(self, ids):
            return [{rid: w.state.held(rid) for rid in ids} for w in self.w]

        async def release(self, ids):
            for w in self.w:
                w.state.release(list(ids))
            return await super().release(ids)

    return StagesPipeline()


class TwinSwap:
    """Arranges the twin frame between stage 0 and stage 1, then swaps the twins' stamps in it."""

    def __init__(self, stage1) -> None:
        self.stage1 = stage1
        self.phase = 0
        self.swapped = 0

    def __call__(self, forward: stage_pb2.Frame) -> None:
        s = {slot.stamp.request_id: slot.stamp for slot in forward.slots}
        if "a" not in s or "b" not in s:
            return
        a, b = s["a"], s["b"]
        if self.phase == 0 and a.position == b.position > 0:
            self.stage1.state.release(["a"])             # A is rejected here: rebuilt, replayed from 0
            self.phase = 1
        elif self.phase == 1 and a.position == 0 < b.position:
            self.stage1.state.release(["b"])             # B decoding while A replays: B rebuilt in turn
            self.phase = 2
        elif self.phase == 2 and a.context_hash == b.context_hash and a.position != b.position:
            i, j = [k for k, slot in enumerate(forward.slots) if slot.stamp.request_id in ("a", "b")]
            x, y = stage_pb2.Stamp(), stage_pb2.Stamp()
            x.CopyFrom(forward.slots[i].stamp)
            y.CopyFrom(forward.slots[j].stamp)
            forward.slots[i].stamp.CopyFrom(y)
            forward.slots[j].stamp.CopyFrom(x)
            self.swapped += 1
            self.phase = 3


async def _generate(pipe, rids: list[str]) -> tuple[dict[str, list], object]:
    tok = load_model_tokenizer(resolve_model("tiny"))
    seed = hash_seed(reference.load("tiny").fingerprint, "")
    driver = Driver(pipe, frame_timeout_s=30)
    task = supervise.start("driver", driver.run, driver.crashed, restart_s=0)
    try:
        while not driver.serving:
            await asyncio.sleep(0.01)
        sinks = {rid: driver.submit(Request(Sequence(rid, list(PROMPT), PARAMS, tok, seed, 4096))) for rid in rids}
        out: dict[str, list] = {}
        for rid, events in sinks.items():
            got = out[rid] = []
            while True:
                ev = await asyncio.wait_for(events.get(), 60)
                got.append(ev)
                if isinstance(ev, Failure) or ev.finish_reason:
                    break
        return out, driver.counters
    finally:
        task.cancel()


def test_swapped_twins_both_end_exactly_as_generated_alone(kit, slices):
    pipe = stages_pipeline(kit, slices)
    swap = pipe.between = TwinSwap(pipe.w[1])
    out, counters = asyncio.run(_generate(pipe, ["a", "b"]))
    assert swap.swapped == 1, f"the twin frame never came (phase {swap.phase}): the test proves nothing"
    expected = list(reference.generate_ids(reference.load("tiny"), PROMPT, PARAMS).output_ids)
    for rid in ("a", "b"):
        assert not any(isinstance(e, Failure) for e in out[rid]), out[rid]
        assert [e.token_id for e in out[rid]] == expected, f"twin {rid} answered wrongly"
    assert counters.rejections["DIGEST_MISMATCH"] == 2, counters.rejections   # both twins refused, then rebuilt
