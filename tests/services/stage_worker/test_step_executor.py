"""Where a stage's steps run (server.step_executor): the last stage on the event loop's thread, the others on a
step thread of their own, each call's result or exception reaching its awaiting caller either way."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.stage_worker.server import InlineExecutor, step_executor


def test_the_last_stage_runs_its_steps_on_the_loops_thread_the_others_on_a_step_thread():
    async def where(executor) -> tuple[int, int]:
        loop_thread = threading.get_ident()
        ran_on = await asyncio.get_running_loop().run_in_executor(executor, threading.get_ident)
        return loop_thread, ran_on

    last = step_executor(last=True)
    assert isinstance(last, InlineExecutor)
    on_loop, ran = asyncio.run(where(last))
    assert ran == on_loop
    other = step_executor(last=False)
    assert isinstance(other, ThreadPoolExecutor)
    try:
        on_loop, ran = asyncio.run(where(other))
        assert ran != on_loop
    finally:
        other.shutdown()


def test_an_inline_call_runs_once_and_in_order_and_its_exception_reaches_the_await():
    calls: list[int] = []

    def step(i: int) -> int:
        calls.append(i)
        if i == 2:
            raise ValueError("step 2 failed")
        return i * 10

    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        ex = InlineExecutor()
        out = [await loop.run_in_executor(ex, step, 1)]
        with pytest.raises(ValueError, match="step 2 failed"):
            await loop.run_in_executor(ex, step, 2)
        out.append(await loop.run_in_executor(ex, step, 3))
        return out

    assert asyncio.run(run()) == [10, 30] and calls == [1, 2, 3]
