"""When and how long the SDK waits before trying a refused or failed request again.

Three pieces, so that each rule is testable without a server or a real clock:

- `RetryPolicy` (frozen, pure): which status codes are worth another attempt, how many attempts, and the
  backoff. Backoff is exponential with *full jitter* (Marc Brooker, "Exponential Backoff And Jitter", AWS
  Architecture Blog, 2015): retry n waits uniform(0, min(max_backoff_s, base_backoff_s * 2**(n-1))) seconds.
  A RetryInfo delay from the server is a floor: the jitter is added on top of it, so clients refused at the
  same instant do not all come back at the same instant either.
- `RetryBudget` (a token bucket, in the spirit of gRPC's retryThrottling and Finagle's RetryBudget): every
  request deposits `ratio` of a token, every retry spends a whole one, and the balance never exceeds `burst`.
  Over any stretch of time a client retries at most `burst + ratio * requests` times, so when a whole fleet is
  refused the retries add at most `ratio` (10%) to the load instead of multiplying it by the attempt count.
- `Retrier`: a policy and a budget with the clock, the random source and the sleep they run on (all
  injectable); `Retrier.begin(timeout)` starts the bookkeeping of one call (`RetryRun`).

A call's `timeout` bounds all its attempts together: the SDK never sleeps past it, and an attempt is sent with
what is left of it. Every attempt is a new call, started only once the previous one has ended (its status
arrived, or it was cancelled), so one request of the caller is never running twice at the same time.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from tether.client.errors import TetherError

# Worth another attempt: the server refused for load (RESOURCE_EXHAUSTED), could not serve right now
# (UNAVAILABLE: not ready, a pipeline down, an open circuit breaker) or gave up on this run of the request
# (ABORTED: e.g. tokens that could not be verified after the pipeline's own rebuilds).
RETRYABLE_CODES: frozenset[grpc.StatusCode] = frozenset({
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED})

# Never retried, whatever a policy says: the same request would fail the same way (INVALID_ARGUMENT,
# PERMISSION_DENIED, UNAUTHENTICATED), the caller's label is still in flight (ALREADY_EXISTS), or the caller's
# own limit ended it (DEADLINE_EXCEEDED, CANCELLED).
NEVER_RETRIED: frozenset[grpc.StatusCode] = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


@dataclass(frozen=True)
class RetryPolicy:
    """Which failures are tried again, how often and after how long. Pure: no clock, no state.

    max_attempts: attempts in all, the first included (1 = never retry). 3 by default: one refusal or a
        pipeline's restart is usually over by the second attempt, and a third rarely helps an overload.
    base_backoff_s, max_backoff_s: retry n waits uniform(0, min(max, base * 2**(n-1))) (full jitter) plus the
        server's RetryInfo delay, if it gave one. 0.5 s ≈ a readiness poll or a breaker's half-open probe.
    retry_codes: the codes retried, RETRYABLE_CODES by default (one in NEVER_RETRIED is a ValueError).
    exhausted_needs_retry_info: retry RESOURCE_EXHAUSTED only when the server said when (RetryInfo). Without
        one it is a refusal that will not change: gRPC's own "message larger than max", or a context that can
        never fit the pipeline's KV pool.
    max_wait_s: the longest single wait; a server asking for more gets the error raised instead, so a caller
        without a timeout is never parked silently for minutes.
    budget_ratio, budget_burst: the RetryBudget each client builds (see there).
    """

    max_attempts: int = 3
    base_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    retry_codes: frozenset[grpc.StatusCode] = RETRYABLE_CODES
    exhausted_needs_retry_info: bool = True
    max_wait_s: float = 30.0
    budget_ratio: float = 0.1
    # A client at high concurrency loses every request in flight on a pipeline that dies, all at once (its
    # concurrency ÷ the pipelines): the burst covers that for 64 streams over 2 pipelines; past it, 10%.
    budget_burst: float = 32.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1 (the first attempt); got {self.max_attempts}")
        if not (0 <= self.base_backoff_s <= self.max_backoff_s) or not math.isfinite(self.max_backoff_s):
            raise ValueError(f"backoff must satisfy 0 <= base_backoff_s <= max_backoff_s < inf; got "
                             f"base {self.base_backoff_s}, max {self.max_backoff_s}")
        if not self.max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be 0 or more seconds; got {self.max_wait_s}")
        never = set(self.retry_codes) & NEVER_RETRIED
        if never:
            raise ValueError(f"{', '.join(sorted(c.name for c in never))} must never be retried: the same request "
                             f"would fail the same way, or the caller's own deadline or cancel ended it")
        RetryBudget(self.budget_ratio, self.budget_burst)   # the same checks, one place

    def retryable(self, code: grpc.StatusCode, retry_after: float | None = None) -> bool:
        """Whether a failure with this status (and RetryInfo delay, None when the server gave none) is worth
        another attempt at all; attempts, deadline and budget are decided by `next_delay`."""
        if code not in self.retry_codes:
            return False
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and self.exhausted_needs_retry_info:
            return retry_after is not None
        return True

    def backoff(self, retry: int, retry_after: float | None, rand: float) -> float:
        """Seconds to wait before retry number `retry` (1 = the second attempt); `rand` uniform in [0, 1).

        Full jitter on top of the server's RetryInfo delay: the delay is a floor, never shortened."""
        if retry < 1:
            raise ValueError(f"retry numbers start at 1; got {retry}")
        cap = min(self.max_backoff_s, self.base_backoff_s * 2.0 ** (retry - 1))
        return max(retry_after or 0.0, 0.0) + rand * cap

    def next_delay(self, code: grpc.StatusCode, retry_after: float | None, attempts: int, now: float,
                   deadline: float | None, rand: float) -> tuple[float | None, str]:
        """(seconds to wait before the next attempt, "") or (None, why not) after `attempts` failed attempts.

        The budget is not consulted here (it is state): the caller spends a token only when this says go.
        """
        if not self.retryable(code, retry_after):
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and code in self.retry_codes:
                return None, "RESOURCE_EXHAUSTED without a RetryInfo delay is not retried (a limit, not load)"
            return None, f"{code.name} is not retried"
        if attempts >= self.max_attempts:
            return None, f"gave up after {_attempts(attempts)} (max_attempts={self.max_attempts})"
        delay = self.backoff(attempts, retry_after, rand)
        asked = f" (the server asked for at least {retry_after:g} s)" if retry_after else ""
        if delay > self.max_wait_s:
            return None, (f"gave up after {_attempts(attempts)}: the next attempt would be in {delay:.3g} s{asked}, "
                          f"longer than max_wait_s={self.max_wait_s:g}")
        if deadline is not None and now + delay >= deadline:
            return None, (f"gave up after {_attempts(attempts)}: the next attempt would be in {delay:.3g} s{asked}, "
                          f"past the call's deadline ({max(deadline - now, 0.0):.3g} s left)")
        return delay, ""


def _attempts(n: int) -> str:
    return f"{n} attempt" if n == 1 else f"{n} attempts"


class RetryBudget:
    """Retries allowed as a fraction of requests (a token bucket; thread-safe, shared by one client's calls).

    Starts full (`burst` tokens), so a fresh client, e.g. one CLI command, can retry its first request; each
    request deposits `ratio`, each retry withdraws 1, the balance is capped at `burst`. ratio=0.1 means at most
    one retry per ten requests once the burst is spent: a refused fleet adds 10% load, not 3x.
    """

    def __init__(self, ratio: float = 0.1, burst: float = 5.0) -> None:
        if not 0 <= ratio <= 1:
            raise ValueError(f"the retry budget's ratio must be between 0 and 1 (retries per request); got {ratio}")
        if not 0 <= burst < math.inf:
            raise ValueError(f"the retry budget's burst must be a finite number of retries >= 0; got {burst}")
        self.ratio, self.burst = ratio, burst
        self._balance = burst
        self._lock = threading.Lock()   # the blocking client may be shared by threads

    @property
    def balance(self) -> float:
        return self._balance

    def deposit(self) -> None:
        """One request started (its first attempt)."""
        with self._lock:
            self._balance = min(self.burst, self._balance + self.ratio)

    def try_withdraw(self) -> bool:
        """Spend one retry if the budget has it."""
        with self._lock:
            # A small tolerance: ten deposits of 0.1 must make a whole token despite binary floats.
            if self._balance < 1.0 - 1e-9:
                return False
            self._balance = max(self._balance - 1.0, 0.0)
            return True


class Retrier:
    """A policy and a budget with what they run on: `clock` (seconds, monotonic), `rand` (uniform [0, 1)),
    `sleep` (None: time.sleep for the blocking client, asyncio.sleep for AsyncClient; an injected one may be a
    plain function for either, or a coroutine function for AsyncClient). Tests inject all three."""

    def __init__(self, policy: RetryPolicy | None = None, budget: RetryBudget | None = None,
                 clock: Callable[[], float] = time.monotonic, rand: Callable[[], float] = random.random,
                 sleep: Callable[[float], object] | None = None) -> None:
        self.policy = policy if policy is not None else RetryPolicy()
        self.budget = budget if budget is not None else RetryBudget(self.policy.budget_ratio,
                                                                    self.policy.budget_burst)
        self.clock, self.rand, self.sleep = clock, rand, sleep

    def begin(self, timeout: float | None) -> "RetryRun":
        """Start one call of the caller's (all its attempts): deposits into the budget."""
        self.budget.deposit()
        return RetryRun(self, None if timeout is None else self.clock() + timeout, timeout)


NO_RETRY = RetryPolicy(max_attempts=1)


def make_retrier(retry: "RetryPolicy | Retrier | bool | None") -> Retrier:
    """What a client's `retry=` argument means: True = the default policy, None/False = one attempt only."""
    if isinstance(retry, Retrier):
        return retry
    if isinstance(retry, RetryPolicy):
        return Retrier(retry)
    if retry is True:
        return Retrier(RetryPolicy())
    if retry is None or retry is False:
        return Retrier(NO_RETRY)
    raise TypeError(f"retry must be a RetryPolicy, a Retrier, True, False or None; got {type(retry).__name__}")


class RetryRun:
    """The attempts of one call: its deadline, how many were made, whether another one may follow."""

    def __init__(self, retrier: Retrier, deadline: float | None, timeout: float | None) -> None:
        self._retrier = retrier
        self.deadline = deadline
        self.timeout = timeout
        self.attempts = 0

    def attempt_timeout(self) -> float | None:
        """Count a new attempt and return its gRPC timeout: what is left of the call's."""
        self.attempts += 1
        if self.deadline is None:
            return None
        # never 0 or less: gRPC would take that as "no deadline"-like nonsense; a tiny one fails promptly
        return max(self.deadline - self._retrier.clock(), 1e-3)

    def after_failure(self, error: TetherError) -> float | None:
        """Seconds to wait before the next attempt, or None: give up and raise `error` (which this annotates
        with `.attempts` and `.gave_up`, the reason no further attempt was made)."""
        r = self._retrier
        delay, why = r.policy.next_delay(error.code, error.retry_after, self.attempts, r.clock(), self.deadline,
                                         r.rand())
        if delay is not None and not r.budget.try_withdraw():
            delay, why = None, (f"gave up after {_attempts(self.attempts)}: this client's retry budget is spent "
                                f"(at most {r.budget.ratio:g} retries per request beyond a burst of "
                                f"{r.budget.burst:g}), so a fleet of clients does not multiply an overload")
        error.attempts = self.attempts
        error.gave_up = why
        return delay
