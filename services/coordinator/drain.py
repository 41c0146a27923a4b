"""The coordinator's one drain routine, whoever asks for it: SIGTERM (then the process exits) and the Drain RPC
(`tether drain`, admission; the process exits only if the call asks).

Draining takes no new request from the moment it is asked (the driver refuses them, the load report says
draining, so admission routes elsewhere at once), lets what is active finish until the deadline, then hands the
rest back to admission (UNAVAILABLE with TokenEvent.handed_back), which continues it on another pipeline.
Asking again never starts a second drain: it can only bring the deadline nearer (the earliest asked wins), so a
SIGTERM during a long drain called for by an operator still ends within --drain-seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.coordinator.driver import Driver

log = logging.getLogger("coordinator")
_POLL_S = 0.05        # how often the drain looks whether everything active has ended
FLUSH_S = 0.2        # after the hand-back: the Sessions write it before a server that stops closes them


class Drain:
    def __init__(self, driver: Driver, default_s: float,
                 on_start: Callable[[], Awaitable[None]] | None = None) -> None:
        self.driver = driver
        self.default_s = default_s   # --drain-seconds: what SIGTERM and a call asking for 0 get
        self.on_start = on_start     # e.g. the gRPC health to NOT_SERVING
        self.deadline: float | None = None   # loop time at which what is still active is handed back
        self.handed_back = 0
        self.task: asyncio.Task | None = None

    def start(self, seconds: float | None = None) -> bool:
        """Drain within `seconds` (None or 0: --drain-seconds). Whether this call started it (False: it was
        draining already; the deadline moved nearer if this one is nearer). From now on no request is taken."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (seconds or self.default_s)
        self.driver.draining = True   # at once, before the task runs: the very next Submit is refused
        if self.task is not None:
            assert self.deadline is not None
            self.deadline = min(self.deadline, deadline)
            return False
        self.deadline = deadline
        self.task = asyncio.create_task(self._run())
        return True

    def seconds_left(self) -> float:
        if self.deadline is None or (self.task is not None and self.task.done()):
            return 0.0
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def wait(self, seconds: float | None = None) -> None:
        """SIGTERM's path: start (or bring nearer) the drain and wait for its end."""
        self.start(seconds)
        assert self.task is not None
        await asyncio.shield(self.task)

    async def _run(self) -> None:
        if self.on_start is not None:
            await self.on_start()
        loop = asyncio.get_running_loop()
        log.info("draining: %d request(s) active, up to %.3g s", len(self.driver.active()), self.seconds_left())
        while self.driver.active() and self.deadline is not None and loop.time() < self.deadline:
            await asyncio.sleep(_POLL_S)
        self.handed_back = self.driver.hand_back()
        log.info("drained: %d request(s) handed back to admission", self.handed_back)
        await asyncio.sleep(FLUSH_S)
