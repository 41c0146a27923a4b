"""Child processes that die with the launcher that started them (`tether up`, the tests): no orphans.

The launcher passes its pid in TETHER_PARENT_PID; the child asks the kernel for SIGTERM when its parent
dies (Linux PR_SET_PDEATHSIG), set by the child itself at start-up because a `preexec_fn` in a
multi-threaded launcher is unsafe (it crashed children with SIGSEGV).
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Protocol

PARENT_ENV = "TETHER_PARENT_PID"
_PR_SET_PDEATHSIG = 1


class Proc(Protocol):
    """A child process as the launchers use one: subprocess.Popen, or tether.forkserver's ForkedProcess."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def follow_parent() -> None:
    """If a launcher asked for it, die with it; if it is already gone, exit now."""
    parent = os.environ.get(PARENT_ENV)
    if parent:
        die_with(int(parent), "launcher exited before this service started")


def die_with(parent: int, why: str = "parent exited before this process started") -> None:
    """Ask for SIGTERM when `parent` (which must be our parent, and must have spawned us from a thread that
    lives as long as it does) dies; exit now if it is already gone."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return   # not Linux: the launcher's stop() still cleans up on a normal exit
    if os.getppid() != parent:   # the parent died before the request took effect
        raise SystemExit(why)
