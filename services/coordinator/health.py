"""Whether a coordinator's pipeline serves, what it is doing if not, and since when work in flight has been
waiting for it to come back (the recovery window). Admission's readiness hears every change through
`on_serving` (gRPC health): it is told before `serving` turns True, so whoever sees serving finds health agreeing."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable


class PipelineHealth:
    def __init__(self, on_serving: Callable[[bool], Awaitable[None]] | None,
                 spawn: Callable[[Awaitable[None]], None]) -> None:
        self.on_serving = on_serving
        self._spawn = spawn              # runs a coroutine in the background (turning NOT_SERVING never waits)
        self.serving = False
        self.status = "connecting"
        self.down_since: float | None = None   # set while requests in flight wait for the pipeline to come back

    async def up(self) -> None:
        if self.on_serving is not None:
            await self.on_serving(True)
        self.serving, self.status = True, "serving"

    def down(self, status: str) -> None:
        """Not serving any more, because of `status`."""
        if self.serving and self.on_serving is not None:
            self._spawn(self.on_serving(False))
        self.serving = False
        self.status = status

    def broken(self, why: str) -> None:
        """The stream broke: work in flight starts waiting (once) for the pipeline to come back."""
        self.down(f"recovering: {why}")
        if self.down_since is None:
            self.down_since = time.monotonic()

    @property
    def recovering(self) -> bool:
        return self.down_since is not None

    def waited_past(self, window_s: float) -> bool:
        """Whether the work in flight has waited longer than `window_s` (or nothing is waiting at all)."""
        return self.down_since is None or time.monotonic() - self.down_since > window_s

    def recovered(self) -> None:
        self.down_since = None
