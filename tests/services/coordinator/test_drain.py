"""The coordinator's one drain routine (services/coordinator/drain.py), as SIGTERM and the Drain call use it:
no request is taken from the moment it is asked, asking again never starts a second drain and can only bring
the deadline nearer, what ends in time is not handed back, and what is left at the deadline is."""

from __future__ import annotations

import asyncio

from services.coordinator.drain import Drain


class FakeDriver:
    """What the drain uses of the Driver: `draining`, the active requests, and hand_back()."""

    def __init__(self, active: int) -> None:
        self.draining = False
        self.requests = list(range(active))
        self.handed: list[int] = []

    def active(self) -> list:
        return list(self.requests)

    def hand_back(self) -> int:
        self.handed += self.requests
        n, self.requests = len(self.requests), []
        return n


def _drain(driver: FakeDriver, default_s: float = 60.0) -> tuple[Drain, list[str]]:
    calls: list[str] = []

    async def on_start() -> None:
        calls.append("health off")
    return Drain(driver, default_s, on_start=on_start), calls   # type: ignore[arg-type]


def test_asked_once_or_twice_it_is_one_drain_and_refuses_work_at_once():
    async def go() -> None:
        driver = FakeDriver(active=1)
        drain, calls = _drain(driver)
        assert drain.start(30) is True
        assert driver.draining   # before its task has run at all
        first = drain.task
        assert drain.start(45) is False and drain.task is first   # idempotent
        assert 29 < drain.seconds_left() <= 30                     # a later deadline does not extend it
        assert drain.start(5) is False and drain.seconds_left() <= 5   # a nearer one wins
        driver.requests.clear()                                    # what was active ends in time
        await asyncio.wait_for(drain.wait(), 3)                    # well before the 5 s deadline
        assert driver.handed == [] and drain.handed_back == 0 and calls == ["health off"]
        assert driver.draining and drain.seconds_left() == 0
    asyncio.run(go())


def test_what_is_left_at_the_deadline_is_handed_back():
    async def go() -> None:
        driver = FakeDriver(active=3)
        drain, _ = _drain(driver, default_s=0.1)
        await asyncio.wait_for(drain.wait(), 5)   # SIGTERM's path: --drain-seconds
        assert driver.handed == [0, 1, 2] and drain.handed_back == 3
    asyncio.run(go())


def test_sigterm_during_a_long_drain_by_call_ends_within_drain_seconds():
    async def go() -> None:
        driver = FakeDriver(active=2)
        drain, calls = _drain(driver, default_s=0.1)
        assert drain.start(600)                    # an operator's long drain, requests still running
        await asyncio.wait_for(drain.wait(), 5)    # then SIGTERM: --drain-seconds from now, not 600 s
        assert drain.handed_back == 2 and calls == ["health off"]
    asyncio.run(go())


def test_a_call_for_zero_seconds_gets_the_coordinators_drain_seconds():
    async def go() -> None:
        drain, _ = _drain(FakeDriver(active=1), default_s=42)
        drain.start(0)
        assert 41 < drain.seconds_left() <= 42
        assert drain.task is not None
        drain.task.cancel()
    asyncio.run(go())
