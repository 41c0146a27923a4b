"""The frames a coordinator has sent and not yet seen answered: which requests each carries, since when, and
the recent step time (send to reply) that load reports and routing read."""

from __future__ import annotations

import time

from services.coordinator.scheduler import Request

STEP_SMOOTHING = 0.05   # weight of the newest frame in the moving mean of the step time


class FramesInFlight:
    """Stream seq -> (sent at, requests). An empty batch is a keep-alive: it travels the route like a frame but
    holds no request, so it never counts as a micro-batch in flight."""

    def __init__(self) -> None:
        self._frames: dict[int, tuple[float, list[Request]]] = {}
        self.step_seconds = 0.0

    def __bool__(self) -> bool:
        return bool(self._frames)

    def sent(self, seq: int, batch: list[Request]) -> None:
        """Before the frame is written: its reply may be read before the write returns."""
        self._frames[seq] = (time.monotonic(), batch)

    def answered(self, seq: int) -> list[Request] | None:
        """The requests of the frame this reply answers (None: a frame unknown or already given up on)."""
        entry = self._frames.pop(seq, None)
        if entry is None:
            return None
        sent_at, batch = entry
        if batch:
            self.step_seconds += STEP_SMOOTHING * (time.monotonic() - sent_at - self.step_seconds)
        return batch

    def expired(self, timeout_s: float) -> list[list[Request]]:
        """Give up on the frames unanswered for `timeout_s`: their batches, oldest first."""
        now = time.monotonic()
        late = [seq for seq, (t, _) in self._frames.items() if now - t > timeout_s]
        return [self._frames.pop(seq)[1] for seq in late]

    def forget(self) -> list[list[Request]]:
        """The stream is gone: every frame's outcome is unknown. Their batches."""
        batches = [batch for _, batch in self._frames.values()]
        self._frames.clear()
        return batches
