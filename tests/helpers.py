"""Small helpers that several test files share: a clock the test moves by hand, and whether a process lives."""

from __future__ import annotations

import os


class Clock:
    """A clock for code that takes `clock=`: it reads `t`, which only the test moves."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a zombie is dead for the tests' purposes)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
