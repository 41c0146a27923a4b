"""Overload control at the front door (pure logic; the clock is injected): per-tenant token buckets, and
shedding by priority.

Tenants' limits come from a TOML file (`--tenants FILE`):

    [defaults]                 # every tenant not named below
    requests_per_s = 20
    tokens_per_s = 20000       # prompt tokens + output budget
    [tenants.acme]
    requests_per_s = 100
    tokens_per_s = 200000
    burst_s = 2                # bucket depth, in seconds of rate (default 1)
    api_keys_sha256 = ["..."]  # the tenant's API keys, hashed; and `priorities`: read by auth.py

A tenant over either bucket is refused with RESOURCE_EXHAUSTED and a RetryInfo saying when its bucket will
hold the request; other tenants are unaffected. Without a file, no tenant is limited.

Shedding by priority: near the global concurrency cap, sheddable requests are refused first, then standard
ones; critical ones may use the whole cap. A request whose predicted wait already exceeds its deadline is
refused at once rather than failing late.
"""

from __future__ import annotations

import math
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.admission.auth import AUTH_FIELDS
from tether.priority import Priority

# Share of the global concurrency cap each priority may fill: what is above a priority's share is kept for
# the priorities above it.
PRIORITY_SHARE = {Priority.CRITICAL: 1.0, Priority.STANDARD: 0.9, Priority.SHEDDABLE: 0.7}
MAX_TENANTS = 10000     # buckets kept at most: a client minting tenant names cannot grow memory without bound


@dataclass
class TokenBucket:
    rate: float                       # tokens per second
    burst: float                      # bucket depth
    clock: Callable[[], float] = time.monotonic
    level: float = field(init=False)
    at: float = field(init=False)

    def __post_init__(self) -> None:
        self.level, self.at = self.burst, self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available (0: now); inf if it never will be (more than the burst)."""
        self._refill()
        if amount > self.burst:
            return math.inf
        return max(0.0, (amount - self.level) / self.rate) if self.rate > 0 else (0.0 if amount <= self.level else math.inf)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount


@dataclass(frozen=True)
class TenantLimit:
    requests_per_s: float = 0.0       # 0: unlimited
    tokens_per_s: float = 0.0
    burst_s: float = 1.0


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after_s: float


class TenantLimits:
    """Per-tenant request and token buckets."""

    def __init__(self, defaults: TenantLimit | None = None, tenants: dict[str, TenantLimit] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.defaults = defaults or TenantLimit()
        self.tenants = dict(tenants or {})
        self.clock = clock
        self.buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}
        self.refused: dict[str, int] = {}     # tenant -> refusals (Stats)

    @classmethod
    def from_file(cls, path: str | Path, clock: Callable[[], float] = time.monotonic) -> "TenantLimits":
        return cls.from_config(read_tenants_file(path), str(path), clock)

    @classmethod
    def from_config(cls, data: dict, where: str = "tenants file",
                    clock: Callable[[], float] = time.monotonic) -> "TenantLimits":
        """The limits of a parsed tenants file (read_tenants_file); its API keys are auth.py's."""
        return cls(_limit(data.get("defaults", {}), f"{where} [defaults]"),
                   {name: _limit(v, f"{where} [tenants.{name}]", AUTH_FIELDS)
                    for name, v in data.get("tenants", {}).items()},
                   clock)

    @property
    def active(self) -> bool:
        return any(_limited(x) for x in [self.defaults, *self.tenants.values()])

    def check(self, tenant: str, tokens: int) -> Refusal | None:
        """Take one request of `tokens` (prompt + output budget) from the tenant's buckets, or refuse it."""
        limit = self.tenants.get(tenant, self.defaults)
        if not _limited(limit):
            return None
        if tenant not in self.buckets and len(self.buckets) >= MAX_TENANTS:
            self.buckets.pop(next(iter(self.buckets)))   # oldest: a full bucket again is the lenient side
        requests, token_bucket = self.buckets.get(tenant) or self._new(limit)
        self.buckets[tenant] = (requests, token_bucket)
        waits = [b.wait_s(n) for b, n in ((requests, 1), (token_bucket, tokens)) if b is not None]
        wait = max(waits)
        if wait > 0:
            self.refused[tenant] = self.refused.get(tenant, 0) + 1
            if math.isinf(wait):
                return Refusal(f"tenant {tenant or '(default)'} may send at most {token_bucket.burst:.0f} tokens "
                               f"at once; this request needs {tokens} (prompt + max_tokens)", 60.0)
            return Refusal(f"tenant {tenant or '(default)'} is over its rate limit "
                           f"({_describe(limit)}); retry in {wait:.2f}s", wait)
        for b, n in ((requests, 1), (token_bucket, tokens)):
            if b is not None:
                b.take(n)
        return None

    def _new(self, limit: TenantLimit) -> tuple[TokenBucket | None, TokenBucket | None]:
        def bucket(rate: float) -> TokenBucket | None:
            return TokenBucket(rate, max(1.0, rate * limit.burst_s), self.clock) if rate > 0 else None
        return bucket(limit.requests_per_s), bucket(limit.tokens_per_s)


def read_tenants_file(path: str | Path) -> dict:
    """The tenants TOML, its sections checked: ValueError (naming the file) when unreadable or unknown."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"tenant limits file {path}: {e}") from e
    unknown = set(data) - {"defaults", "tenants"}
    if unknown:
        raise ValueError(f"tenant limits file {path}: unknown section(s) {sorted(unknown)}; "
                         f"expected [defaults] and [tenants.NAME]")
    if not isinstance(data.get("tenants", {}), dict):
        raise ValueError(f"tenant limits file {path}: tenants must be tables, [tenants.NAME]")
    return data


def _limited(limit: TenantLimit) -> bool:
    return limit.requests_per_s > 0 or limit.tokens_per_s > 0


def _describe(limit: TenantLimit) -> str:
    parts = [f"{limit.requests_per_s:g} requests/s" if limit.requests_per_s else "",
             f"{limit.tokens_per_s:g} tokens/s" if limit.tokens_per_s else ""]
    return ", ".join(p for p in parts if p)


def _limit(section: dict, where: str, skip: frozenset[str] = frozenset()) -> TenantLimit:
    """A table's limits; the keys in `skip` are someone else's to read (a tenant's API keys)."""
    if not isinstance(section, dict):
        raise ValueError(f"{where}: expected a table")
    unknown = set(section) - {"requests_per_s", "tokens_per_s", "burst_s"} - skip
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}")
    values = {}
    for key, value in section.items():
        if key in skip:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
        values[key] = float(value)
    if values.get("burst_s", 1.0) <= 0:
        raise ValueError(f"{where}: burst_s must be > 0")
    return TenantLimit(**values)


def shed_by_priority(priority: Priority, others: int, cap: int) -> Refusal | None:
    """Refuse a request whose priority may not take another of the cap's slots now: `others` requests are in
    flight besides it. Each priority may fill its share of the cap (rounded, at least one slot)."""
    share = PRIORITY_SHARE.get(priority, PRIORITY_SHARE[Priority.STANDARD])
    if others < max(1, round(cap * share)):
        return None
    return Refusal(f"admission has {others} of its {cap} concurrent requests in flight; {priority} requests are "
                   f"refused above {share:.0%} of it", 1.0)


def shed_by_deadline(predicted_wait_s: float, deadline_s: float | None) -> Refusal | None:
    """Refuse now a request that would wait past its deadline for its first token anyway."""
    if deadline_s is None or predicted_wait_s <= deadline_s:
        return None
    return Refusal(f"the predicted wait for a first token ({predicted_wait_s:.1f}s) exceeds the request's "
                   f"deadline ({deadline_s:.1f}s)", min(predicted_wait_s, 5.0))
