"""The priority classes a request runs under, most urgent first: one type for admission (validation, tagging,
shedding, tenants' keys), the coordinator's scheduler and the CLI.

A StrEnum: each member is equal to its wire spelling ("critical", ...), so it goes into a proto field, a
metric label, a log line or a tenants file unchanged, and a string read from any of them compares equal.
"""

from __future__ import annotations

from enum import StrEnum


class Priority(StrEnum):
    CRITICAL = "critical"     # jumps every queue, may fill the whole concurrency cap: only for tenants that list it
    STANDARD = "standard"     # what a request without a priority gets
    SHEDDABLE = "sheddable"   # refused first near the cap

    @property
    def rank(self) -> int:
        """0, 1, 2 from critical to sheddable: the scheduler's start and preemption order."""
        return PRIORITIES.index(self)


PRIORITIES: tuple[Priority, ...] = tuple(Priority)   # most urgent first
DEFAULT = Priority.STANDARD


def parse(text: str) -> Priority:
    """A caller's priority, case and surrounding spaces ignored; "" is the default. ValueError names the allowed
    values."""
    value = text.strip().lower()
    if not value:
        return DEFAULT
    try:
        return Priority(value)
    except ValueError:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}; got {text!r}") from None


def from_peer(text: str) -> Priority:
    """A priority read from an internal peer (the coordinator's SubmitRequest, which admission has validated):
    "" or anything that is not a priority is the default, the class admission gives a request without one."""
    try:
        return Priority(text)
    except ValueError:
        return DEFAULT
