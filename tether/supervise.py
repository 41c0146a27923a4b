"""Supervised background loops: a long-lived task that dies of an unexpected error is logged once, its
service is told (so it can turn health NOT_SERVING and fail the affected requests explicitly), and the loop
is restarted after a pause. A loop that ends by cancellation (shutdown) is not restarted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from tether import settings

log = logging.getLogger(__name__)


async def supervise(name: str, loop: Callable[[], Awaitable[None]],
                    on_crash: Callable[[BaseException], Awaitable[None]] | None = None,
                    restart_s: float = settings.LOOP_RESTART_S) -> None:
    """Run `loop()` forever: restart it whenever it raises (or returns), after `on_crash(error)`."""
    crashes = 0
    while True:
        try:
            await loop()
            error: BaseException = RuntimeError(f"{name} loop returned")
        except asyncio.CancelledError:
            raise
        except Exception as e:   # noqa: BLE001 - any error of the loop is what supervision is for
            error = e
        crashes += 1
        log.error("%s loop failed (crash %d), restarting in %.1f s: %r", name, crashes, restart_s, error,
                  exc_info=error)
        if on_crash is not None:
            try:
                await on_crash(error)
            except Exception:   # noqa: BLE001 - a failing handler must not stop the restart
                log.exception("%s crash handler failed", name)
        await asyncio.sleep(restart_s)


def start(name: str, loop: Callable[[], Awaitable[None]],
          on_crash: Callable[[BaseException], Awaitable[None]] | None = None,
          restart_s: float = settings.LOOP_RESTART_S) -> asyncio.Task:
    """`supervise` as a task (keep the reference: a task nobody holds may be collected)."""
    return asyncio.create_task(supervise(name, loop, on_crash, restart_s), name=f"supervised:{name}")
