"""The coordinator tells each frame how many micro-batches it has in flight, itself included
(`Frame.frames_in_flight`): at 1 the pipeline's other stages are idle and a stage may use every thread it has.
Against the in-process fake pipeline (labelled as such) of conftest.py, with replies held back."""

from __future__ import annotations

import asyncio

from services.coordinator.driver import Driver
from services.stage_worker.worker import echo
from tether import settings, supervise
from tether.protocol.hashing import ContextHasher, sampling_digest
from tether.v1 import stage_pb2


def test_each_frame_counts_the_micro_batches_in_flight_with_it(kit):
    sent = []

    class Recording(kit.FakePipeline):
        num_stages = 2   # two micro-batches may be out at once

        async def send(self, frame):
            if frame.slots:
                sent.append((frame.slots[0].stamp.request_id, frame.frames_in_flight))
            # no reply: every frame stays in flight

    async def go():
        pipe = Recording(lambda *a: None)
        driver = Driver(pipe)
        task = supervise.start("driver", driver.run, driver.crashed, restart_s=0)
        await kit.until(lambda: driver.serving)
        driver.submit(kit.request("r1"))
        await kit.until(lambda: len(sent) == 1)
        driver.submit(kit.request("r2"))
        await kit.until(lambda: len(sent) == 2)
        await asyncio.sleep(0)
        task.cancel()

    asyncio.run(go())
    assert sent == [("r1", 1), ("r2", 2)]   # r1 alone; r2 sent while r1's frame was out


def test_where_every_stage_widens_few_requests_share_one_micro_batch(kit):
    """Stages that run a micro-batch alone on more threads than under load (their handshake's alone_threads)
    get one micro-batch while few requests are active: r2, arriving while r1's frame is out, waits for it and
    joins it, rather than going out as a second micro-batch (as in the test above)."""
    sent, frames = [], []
    chain = {}

    class Widening(kit.FakePipeline):
        num_stages = 2
        stages = [stage_pb2.StageInfo(kv_block_tokens=settings.ATTENTION_BLOCK, kv_capacity_tokens=1 << 40,
                                      threads=1, alone_threads=2) for _ in range(2)]

        async def send(self, frame):
            if frame.slots:
                sent.append(([s.stamp.request_id for s in frame.slots], frame.frames_in_flight))
                frames.append(frame)

    def answer(frame) -> stage_pb2.FrameReply:
        """Every slot's token, signed as the last stage would (the fake pipeline's stamp key)."""
        results = []
        for slot in frame.slots:
            st = slot.stamp
            hasher = chain.setdefault(st.request_id, ContextHasher(slot.hash_seed))
            hasher.extend(st.token_ids)
            res = stage_pb2.SlotResult(stamp=echo(st), ok=True, has_token=True, token_id=66)
            res.token_hash = Widening.stamp_key.token_mac(hasher.peek([66]), st.request_id, st.epoch,
                                                          st.position + len(st.token_ids),
                                                          sampling_digest(slot.sampling), 66)
            results.append(res)
        return stage_pb2.FrameReply(stream_seq=frame.stream_seq, results=results)

    async def go():
        pipe = Widening(lambda *a: None)
        driver = Driver(pipe, alone_max=16)
        task = supervise.start("driver", driver.run, driver.crashed, restart_s=0)
        await kit.until(lambda: driver.serving)
        driver.submit(kit.request("r1"))
        await kit.until(lambda: len(sent) == 1)
        driver.submit(kit.request("r2"))
        await asyncio.sleep(0)                     # the feed loop looks at r2 before r1's reply lands
        pipe.replies_q.put_nowait(answer(frames[0]))
        await kit.until(lambda: len(sent) == 2)
        task.cancel()

    asyncio.run(go())
    assert sent == [(["r1"], 1), (["r1", "r2"], 1)]
