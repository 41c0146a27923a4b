"""Where injected faults take effect in a running service: the async wrapper of an outbound stream (it sleeps
for a delay and schedules the late flush of a held frame) and the crash (the process exits at once).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from tether.faults.injector import FaultInjector, HeldFrames
from tether.v1 import stage_pb2

CRASH_STATUS = 137   # what a process killed by SIGKILL reports; the chaos bench tells an injected crash by it


def crash(log: logging.Logger) -> None:
    """Die now, as an injected crash: say so, flush the logs (the ledger's last lines), exit without cleanup."""
    log.critical("fault injection: crashing now (exit %d)", CRASH_STATUS)
    for h in logging.getLogger().handlers:
        h.flush()
    os._exit(CRASH_STATUS)


class OutboundFaults:
    """An injector applied to one outbound stream (a stage's downstream, the coordinator's Forward): the
    delay, then whatever `outbound` returns, written in order. A frame held back for reordering whose
    successor does not come within `hold_s` goes out alone, late."""

    def __init__(self, injector: FaultInjector, write: Callable[[stage_pb2.Frame], Awaitable[None]]) -> None:
        self.injector = injector
        self.write = write
        self.held = HeldFrames()
        self.flush_task: asyncio.Task | None = None

    async def send(self, frame: stage_pb2.Frame) -> None:
        delay = self.injector.delay_s()
        if delay:
            await asyncio.sleep(delay)
        for f in self.injector.outbound(frame, self.held):
            await self.write(f)
        if self.held and self.flush_task is None:
            self.flush_task = asyncio.create_task(self._flush_later())
        elif not self.held and self.flush_task is not None:
            self.flush_task.cancel()   # still asleep: the held frame went out behind this one
            self.flush_task = None

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.injector.config.hold_s)
        self.flush_task = None         # from here on, not cancellable by `send`: the frames are taken
        try:
            for f in self.injector.flush(self.held):
                await self.write(f)
        except Exception:   # noqa: BLE001 - the stream broke; its reader reports that
            pass

    async def drain(self) -> None:
        """The stream ends: a frame still held goes out now (in order: nothing came after it)."""
        for f in self.injector.flush(self.held):
            await self.write(f)

    def close(self) -> None:
        if self.flush_task is not None:
            self.flush_task.cancel()
            self.flush_task = None
        self.held.take()
