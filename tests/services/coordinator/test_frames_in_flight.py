"""The coordinator tells each frame how many micro-batches it has in flight, itself included
(`Frame.frames_in_flight`): at 1 the pipeline's other stages are idle and a stage may use every thread it has.
Against the in-process fake pipeline (labelled as such) of conftest.py, with replies held back."""

from __future__ import annotations

import asyncio

from services.coordinator.driver import Driver
from tether import supervise


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
