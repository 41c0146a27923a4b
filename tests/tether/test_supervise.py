"""Supervised loops (tether/supervise.py): restarted after an error, told to the service, never after a cancel."""

from __future__ import annotations

import asyncio

import pytest

from tether.supervise import supervise


def test_a_failing_loop_is_reported_and_restarted():
    async def go():
        runs, crashes = [], []

        async def loop():
            runs.append(1)
            if len(runs) < 3:
                raise ValueError(f"boom {len(runs)}")
            await asyncio.Event().wait()   # the third run stays up

        async def on_crash(e):
            crashes.append(str(e))

        task = asyncio.create_task(supervise("t", loop, on_crash, restart_s=0))
        while len(runs) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return runs, crashes

    runs, crashes = asyncio.run(go())
    assert len(runs) == 3 and crashes == ["boom 1", "boom 2"]


def test_a_loop_that_returns_counts_as_a_crash_and_a_failing_handler_does_not_stop_the_restart():
    async def go():
        runs = []

        async def loop():
            runs.append(1)
            if len(runs) >= 3:
                await asyncio.Event().wait()

        async def on_crash(e):
            raise RuntimeError("handler bug")

        task = asyncio.create_task(supervise("t", loop, on_crash, restart_s=0))
        while len(runs) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        return len(runs)

    assert asyncio.run(go()) == 3


def test_cancellation_is_not_a_crash():
    async def go():
        crashes = []

        async def loop():
            await asyncio.Event().wait()

        async def on_crash(e):
            crashes.append(e)

        task = asyncio.create_task(supervise("t", loop, on_crash, restart_s=0))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return crashes

    assert asyncio.run(go()) == []
