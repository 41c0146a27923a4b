"""Small integer arithmetic shared across packages, written once so that its rounding is read once."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, in exact integers (no float: `math.ceil(a / b)` rounds wrongly past 2**53)."""
    return -(-a // b)
