"""tether/mathutil.py: exact rounding-up division."""

import pytest

from tether.mathutil import ceil_div


@pytest.mark.parametrize("a,b,want", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 1, 9)])
def test_ceil_div_rounds_up(a, b, want):
    assert ceil_div(a, b) == want


def test_ceil_div_stays_exact_past_float_precision():
    a = 2**60 + 1
    assert ceil_div(a, 2) == 2**59 + 1
