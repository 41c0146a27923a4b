"""Child processes that die with the launcher that started them (`tether up`, the tests): no orphans.

The launcher passes its pid in TETHER_PARENT_PID; the child asks the kernel for SIGTERM when its parent
dies (Linux PR_SET_PDEATHSIG), set by the child itself at start-up because a `preexec_fn` in a
multi-threaded launcher is unsafe (it crashed children with SIGSEGV).
"""

from __future__ import annotations

import ctypes
import os
import signal

PARENT_ENV = "TETHER_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def follow_parent() -> None:
    """If a launcher asked for it, die with it; if it is already gone, exit now."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return   # not Linux: the launcher's stop() still cleans up on a normal exit
    if os.getppid() != int(parent):   # the parent died before the request took effect
        raise SystemExit("launcher exited before this service started")
