"""A circuit breaker per pipeline (pure logic; the clock is injected).

closed    requests flow; `failure_threshold` failures in a row (errors, timeouts, or the pipeline reporting
          itself down) open it.
open      no request is routed there; after `open_s` it lets probes through (half-open). Each time a probe
          fails the wait doubles, up to `max_open_s`, so a pipeline that stays broken is tried rarely.
half-open at most `probes` requests at a time; one success closes it, one failure opens it again.

Only failures that say something about the pipeline count: UNAVAILABLE, INTERNAL, DEADLINE_EXCEEDED from
the coordinator, a broken stream. A client's cancel, its bad input or its tenant's limit never do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class CircuitBreaker:
    failure_threshold: int = 5
    open_s: float = 2.0
    max_open_s: float = 30.0
    probes: int = 1
    clock: Callable[[], float] = time.monotonic
    state: str = CLOSED
    failures: int = 0                 # in a row, while closed
    opened_at: float = 0.0
    wait_s: float = field(init=False)
    probing: int = 0                  # probes in flight while half-open
    opens: int = 0                    # times it opened (Stats)

    def __post_init__(self) -> None:
        self.wait_s = self.open_s

    def allow(self) -> bool:
        """Whether a request may be routed there now. While half-open, a True is a probe: report its outcome."""
        if self.state == OPEN and self.clock() - self.opened_at >= self.wait_s:
            self.state, self.probing = HALF_OPEN, 0
        if self.state == CLOSED:
            return True
        if self.state == HALF_OPEN and self.probing < self.probes:
            self.probing += 1
            return True
        return False

    def would_allow(self) -> bool:
        """`allow` without taking a probe: for filtering candidates before one is picked."""
        if self.state == OPEN:
            return self.clock() - self.opened_at >= self.wait_s
        return self.state == CLOSED or self.probing < self.probes

    def success(self) -> None:
        if self.state == HALF_OPEN:
            self.wait_s = self.open_s
        self.state, self.failures, self.probing = CLOSED, 0, 0

    def failure(self) -> None:
        if self.state == HALF_OPEN:
            self.wait_s = min(self.max_open_s, self.wait_s * 2)
            self._open()
            return
        self.failures += 1
        if self.state == CLOSED and self.failures >= self.failure_threshold:
            self._open()

    def neutral(self) -> None:
        """A request ended in a way that says nothing about the pipeline (cancelled, refused for its input): a
        probe it held is free again, or a half-open breaker would wait forever for that probe's verdict."""
        if self.state == HALF_OPEN and self.probing:
            self.probing -= 1

    def trip(self) -> None:
        """Open now: the pipeline said it is down (its load report or health)."""
        if self.state != OPEN:
            self._open()

    def _open(self) -> None:
        self.state, self.opened_at, self.probing, self.failures = OPEN, self.clock(), 0, 0
        self.opens += 1

    def retry_after_s(self) -> float:
        """When a request refused for this breaker could try again."""
        if self.state != OPEN:
            return 0.0
        return max(0.0, self.wait_s - (self.clock() - self.opened_at))
