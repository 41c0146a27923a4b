"""The circuit breaker's state machine, on an injected clock."""

from services.admission.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from tests.helpers import Clock


def test_opens_after_failures_in_a_row_only():
    b = CircuitBreaker(failure_threshold=3, clock=Clock())
    b.failure(); b.failure(); b.success(); b.failure(); b.failure()
    assert b.state == CLOSED and b.allow()
    b.failure()
    assert b.state == OPEN and not b.allow() and not b.would_allow() and b.opens == 1


def test_half_open_probes_then_closes_on_success():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, open_s=2.0, probes=1, clock=clock)
    b.failure()
    clock.t = 1.9
    assert not b.allow() and b.retry_after_s() == pytest_approx(0.1)
    clock.t = 2.0
    assert b.would_allow()
    assert b.allow() and b.state == HALF_OPEN
    assert not b.allow()            # one probe at a time
    b.success()
    assert b.state == CLOSED and b.allow()


def test_failed_probe_reopens_with_a_longer_wait_up_to_the_maximum():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, open_s=1.0, max_open_s=3.0, clock=clock)
    b.failure()
    waits = []
    for _ in range(4):
        clock.t += b.wait_s
        assert b.allow()
        b.failure()
        waits.append(b.wait_s)
    assert waits == [2.0, 3.0, 3.0, 3.0]
    clock.t += 3.0
    assert b.allow()
    b.success()
    assert b.wait_s == 1.0          # a success resets the backoff


def test_trip_opens_at_once():
    b = CircuitBreaker(clock=Clock())
    b.trip()
    assert b.state == OPEN and not b.allow()


def pytest_approx(x):
    import pytest
    return pytest.approx(x)


def test_a_probe_that_ends_without_a_verdict_frees_its_slot():
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, open_s=1.0, probes=1, clock=clock)
    b.failure()
    clock.t = 1.0
    assert b.allow() and b.state == HALF_OPEN and not b.allow()
    b.neutral()                     # the probe was cancelled by its client: no verdict
    assert b.allow()                # another request may probe, instead of the breaker staying half-open forever
    b.success()
    assert b.state == CLOSED
