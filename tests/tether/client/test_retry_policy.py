"""The SDK's retry rules without a server: the policy (pure), the budget (a token bucket) and one call's run,
on an injected clock and random source."""

from __future__ import annotations

import grpc
import pytest

from tether.client.errors import ResourceExhausted, TetherError, Unavailable
from tether.client.retry import NEVER_RETRIED, RETRYABLE_CODES, Retrier, RetryBudget, RetryPolicy, make_retrier
from tests.helpers import Clock

C = grpc.StatusCode


# ---- which failures ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code", [C.UNAVAILABLE, C.ABORTED])
def test_unavailable_and_aborted_are_retried_with_or_without_retry_info(code):
    p = RetryPolicy()
    assert p.retryable(code) and p.retryable(code, 0.5)


def test_resource_exhausted_is_retried_only_when_the_server_said_when():
    p = RetryPolicy()
    assert p.retryable(C.RESOURCE_EXHAUSTED, 1.0)
    assert not p.retryable(C.RESOURCE_EXHAUSTED, None)     # message too large, context beyond the KV pool
    assert RetryPolicy(exhausted_needs_retry_info=False).retryable(C.RESOURCE_EXHAUSTED, None)
    delay, why = p.next_delay(C.RESOURCE_EXHAUSTED, None, 1, 0.0, None, 0.5)
    assert delay is None and "without a RetryInfo" in why


@pytest.mark.parametrize("code", sorted(NEVER_RETRIED | {C.INTERNAL, C.UNKNOWN, C.DATA_LOSS, C.NOT_FOUND},
                                        key=lambda c: c.name))
def test_everything_else_is_not_retried_even_with_retry_info(code):
    delay, why = RetryPolicy().next_delay(code, 1.0, 1, 0.0, None, 0.5)
    assert delay is None and why == f"{code.name} is not retried"


@pytest.mark.parametrize("code", sorted(NEVER_RETRIED, key=lambda c: c.name))
def test_a_policy_cannot_be_told_to_retry_what_must_never_be(code):
    with pytest.raises(ValueError, match=f"{code.name} must never be retried"):
        RetryPolicy(retry_codes=RETRYABLE_CODES | {code})


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_attempts=0), "max_attempts must be at least 1"),
    (dict(base_backoff_s=2.0, max_backoff_s=1.0), "base_backoff_s <= max_backoff_s"),
    (dict(base_backoff_s=-1.0), "0 <= base_backoff_s"),
    (dict(budget_ratio=1.5), "ratio must be between 0 and 1"),
    (dict(budget_burst=-1), "burst must be"),
])
def test_nonsense_settings_are_refused_with_the_reason(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RetryPolicy(**kwargs)


# ---- how long ---------------------------------------------------------------------------------------------------

def test_full_jitter_spans_zero_to_the_exponential_cap():
    p = RetryPolicy(base_backoff_s=0.5, max_backoff_s=3.0)
    assert [p.backoff(n, None, 0.0) for n in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert [p.backoff(n, None, 0.999999) for n in (1, 2, 3, 4, 5)] == pytest.approx([0.5, 1.0, 2.0, 3.0, 3.0],
                                                                                   rel=1e-5)
    assert p.backoff(2, None, 0.5) == pytest.approx(0.5)


def test_retry_info_is_a_floor_with_the_jitter_on_top():
    p = RetryPolicy(base_backoff_s=0.5, max_backoff_s=3.0)
    assert p.backoff(1, 1.0, 0.0) == 1.0                 # never shorter than the server asked
    assert p.backoff(1, 1.0, 0.5) == pytest.approx(1.25)  # spread above it, so refused clients do not return together
    assert p.backoff(1, 20.0, 0.0) == 20.0               # the server's word beats max_backoff_s


def test_a_server_asking_for_too_long_a_wait_gets_the_error_raised():
    p = RetryPolicy(max_wait_s=30.0)
    assert p.next_delay(C.UNAVAILABLE, 29.0, 1, 0.0, None, 0.0) == (29.0, "")
    delay, why = p.next_delay(C.UNAVAILABLE, 3600.0, 1, 0.0, None, 0.0)
    assert delay is None and "longer than max_wait_s=30" in why


def test_retry_numbers_start_at_one():
    with pytest.raises(ValueError, match="start at 1"):
        RetryPolicy().backoff(0, None, 0.5)


def test_attempts_are_capped():
    p = RetryPolicy(max_attempts=3)
    assert p.next_delay(C.UNAVAILABLE, None, 2, 0.0, None, 0.5)[0] is not None
    delay, why = p.next_delay(C.UNAVAILABLE, None, 3, 0.0, None, 0.5)
    assert delay is None and "after 3 attempts (max_attempts=3)" in why


def test_never_sleeps_past_the_deadline():
    p = RetryPolicy()
    assert p.next_delay(C.RESOURCE_EXHAUSTED, 1.0, 1, now=10.0, deadline=11.5, rand=0.0) == (1.0, "")
    delay, why = p.next_delay(C.RESOURCE_EXHAUSTED, 1.0, 1, now=10.0, deadline=10.9, rand=0.0)
    assert delay is None and why == ("gave up after 1 attempt: the next attempt would be in 1 s (the server asked "
                                     "for at least 1 s), past the call's deadline (0.9 s left)")
    # the jitter counts too: 1 + 0.999 * 0.5 lands past 11.4
    assert p.next_delay(C.RESOURCE_EXHAUSTED, 1.0, 1, now=10.0, deadline=11.4, rand=0.999)[0] is None


# ---- the budget -------------------------------------------------------------------------------------------------

def test_budget_starts_full_and_then_allows_a_fraction_of_requests():
    b = RetryBudget(ratio=0.1, burst=2.0)
    assert b.try_withdraw() and b.try_withdraw() and not b.try_withdraw()   # the burst, then nothing
    for _ in range(9):
        b.deposit()
    assert not b.try_withdraw()             # 0.9 of a token
    b.deposit()
    assert b.try_withdraw()                 # ten requests bought one retry
    assert not b.try_withdraw()


def test_budget_never_holds_more_than_its_burst():
    b = RetryBudget(ratio=0.5, burst=1.0)
    for _ in range(100):
        b.deposit()
    assert b.balance == 1.0 and b.try_withdraw() and not b.try_withdraw()


def test_a_zero_budget_allows_no_retry():
    b = RetryBudget(ratio=0.0, burst=0.0)
    b.deposit()
    assert not b.try_withdraw()


def test_under_a_total_outage_retries_stay_a_fraction_of_requests():
    """A fleet's worth of requests, every attempt refused: retries <= burst + ratio * requests, not 2x requests."""
    retrier = Retrier(RetryPolicy(max_attempts=3, budget_ratio=0.1, budget_burst=5), clock=Clock(100.0),
                      rand=lambda: 0.0)
    retries = 0
    for _ in range(1000):
        run = retrier.begin(None)
        run.attempt_timeout()
        while run.after_failure(Unavailable("down", C.UNAVAILABLE)) is not None:
            retries += 1
            run.attempt_timeout()
    assert retries <= 5 + 0.1 * 1000
    assert retries >= 100          # and the budget is spent, not hoarded


# ---- one call's run -------------------------------------------------------------------------------------------

def test_a_run_counts_attempts_gives_each_the_time_left_and_annotates_the_error():
    clock = Clock(100.0)
    retrier = Retrier(RetryPolicy(max_attempts=3), clock=clock, rand=lambda: 0.0)
    run = retrier.begin(timeout=5.0)
    assert run.attempt_timeout() == 5.0 and run.attempts == 1
    refused = ResourceExhausted("busy", retry_after=1.0)
    assert run.after_failure(refused) == 1.0 and refused.attempts == 1 and refused.gave_up == ""
    clock.t += 1.0
    assert run.attempt_timeout() == 4.0 and run.attempts == 2
    clock.t += 3.5                                          # the second attempt took its time
    again = ResourceExhausted("busy", retry_after=1.0)
    assert run.after_failure(again) is None
    assert again.attempts == 2 and "past the call's deadline (0.5 s left)" in again.gave_up


def test_a_run_without_budget_gives_up_and_says_so():
    retrier = Retrier(RetryPolicy(budget_ratio=0.0, budget_burst=0.0), clock=Clock(100.0), rand=lambda: 0.0)
    run = retrier.begin(None)
    run.attempt_timeout()
    error = Unavailable("down", C.UNAVAILABLE)
    assert run.after_failure(error) is None and "retry budget is spent" in error.gave_up


def test_a_refused_retry_spends_no_budget():
    retrier = Retrier(RetryPolicy(budget_ratio=0.0, budget_burst=1.0), clock=Clock(100.0), rand=lambda: 0.0)
    run = retrier.begin(None)
    run.attempt_timeout()
    assert run.after_failure(TetherError("bad", C.INVALID_ARGUMENT)) is None
    assert retrier.budget.balance == 1.0


def test_the_retry_argument():
    assert make_retrier(True).policy == RetryPolicy()
    assert make_retrier(None).policy.max_attempts == 1 and make_retrier(False).policy.max_attempts == 1
    p = RetryPolicy(max_attempts=5)
    assert make_retrier(p).policy is p
    r = Retrier(p)
    assert make_retrier(r) is r
    with pytest.raises(TypeError, match="retry must be a RetryPolicy"):
        make_retrier(3)
