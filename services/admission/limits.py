"""Overload control at the front door (pure logic; the clock is injected): per-tenant token buckets, each
tenant's fair share of the concurrency cap, and shedding by priority.

Tenants' limits come from a TOML file (`--tenants FILE`):

    [defaults]                 # every tenant, for what its own table does not set
    requests_per_s = 20
    tokens_per_s = 20000       # prompt tokens + output budget
    max_concurrent = 64        # requests in flight at once (default 0: only the fair share below bounds them)
    [tenants.acme]
    requests_per_s = 100
    tokens_per_s = 200000
    burst_s = 2                # bucket depth, in seconds of rate (default 1)
    api_keys_sha256 = ["..."]  # the tenant's API keys, hashed; and `priorities`: read by auth.py

Accounts: a tenant the file names spends its own limits. Every other tenant name - one a caller claims in the
request body, which without API keys nobody checks - spends one shared account, ANONYMOUS, with the [defaults]
limits: a new name per request buys no fresh bucket and no extra share. (Once any key is configured every
request runs as its key's tenant, which the file names.) Without a file, nobody is limited.

A tenant over either bucket is refused with RESOURCE_EXHAUSTED and a RetryInfo saying when its bucket will
hold the request; other tenants are unaffected. The request bucket is checked before any work on the request
(`admit`), the token bucket again once the request is tokenized (`charge`).

Fair share (ConcurrencyShares): a tenant alone may fill the global cap; once more than FAIR_SHARE_CONTENDED of
it is in flight, each tenant may hold at most an equal part of the cap among the tenants wanting slots, so a
tenant holding every slot with long generations cannot keep a newcomer out for longer than its requests last.

Shedding by priority: near the global concurrency cap, sheddable requests are refused first, then standard
ones; critical ones may use the whole cap. A request whose predicted wait already exceeds its deadline is
refused at once rather than failing late.
"""

from __future__ import annotations

import dataclasses
import math
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.admission.auth import AUTH_FIELDS
from tether import settings
from tether.priority import Priority

# Share of the global concurrency cap each priority may fill: what is above a priority's share is kept for
# the priorities above it.
PRIORITY_SHARE = {Priority.CRITICAL: 1.0, Priority.STANDARD: 0.9, Priority.SHEDDABLE: 0.7}
MAX_TENANTS = 10000     # buckets kept at most: a client minting tenant names cannot grow memory without bound
ANONYMOUS = "(anonymous)"   # the shared account of every tenant the file does not name (never a tenant name)


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
    max_concurrent: int = 0           # requests in flight; 0: only the fair share bounds them


@dataclass(frozen=True)
class Refusal:
    message: str
    retry_after_s: float
    reason: str = ""                  # the shed counter's label, where the caller does not choose its own


def describe(account: str, tenant: str) -> str:
    """The account, as a refusal names it to the caller of `tenant` (the subject of a singular verb)."""
    if account == ANONYMOUS:
        return (f"the account shared by every tenant the tenants file does not name (this request's: "
                f"{tenant[:64]!r})")
    return f"tenant {tenant or '(default)'}"


class TenantLimits:
    """Per-account request and token buckets."""

    def __init__(self, defaults: TenantLimit | None = None, tenants: dict[str, TenantLimit] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.defaults = defaults or TenantLimit()
        self.tenants = dict(tenants or {})
        self.clock = clock
        self.buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}
        self.refused: dict[str, int] = {}     # account -> refusals (Stats)

    @classmethod
    def from_file(cls, path: str | Path, clock: Callable[[], float] = time.monotonic) -> "TenantLimits":
        return cls.from_config(read_tenants_file(path), str(path), clock)

    @classmethod
    def from_config(cls, data: dict, where: str = "tenants file",
                    clock: Callable[[], float] = time.monotonic) -> "TenantLimits":
        """The limits of a parsed tenants file (read_tenants_file); its API keys are auth.py's. A tenant's table
        overrides [defaults] key by key: a tenant listed only for its keys has the default limits."""
        defaults = _limit(data.get("defaults", {}), f"{where} [defaults]")
        return cls(defaults, {name: _limit(v, f"{where} [tenants.{name}]", AUTH_FIELDS, defaults)
                              for name, v in data.get("tenants", {}).items()},
                   clock)

    @property
    def active(self) -> bool:
        return any(_limited(x) for x in [self.defaults, *self.tenants.values()])

    def account(self, tenant: str) -> str:
        """Whose limits `tenant`'s requests spend: its own when the file names it, else ANONYMOUS's."""
        return tenant if tenant in self.tenants else ANONYMOUS

    def limit_of(self, account: str) -> TenantLimit:
        return self.tenants.get(account, self.defaults)

    def admit(self, tenant: str) -> Refusal | None:
        """Before any work on a request: take one from its account's request bucket, or refuse while that is
        empty or its token bucket is spent (less than one token), so a tenant over its rate costs no tokenizing."""
        account = self.account(tenant)
        limit = self.limit_of(account)
        if not _limited(limit):
            return None
        requests, token_bucket = self._buckets(account, limit)
        wait = max([b.wait_s(1) for b in (requests, token_bucket) if b is not None])
        if wait > 0:
            return self._refused(account, Refusal(f"{describe(account, tenant)} is over its rate limit "
                                                  f"({_describe(limit)}); retry in {wait:.2f}s", wait))
        if requests is not None:
            requests.take(1)
        return None

    def charge(self, tenant: str, tokens: int) -> Refusal | None:
        """Once the request is tokenized: take its `tokens` (prompt + output budget) from its account's token
        bucket, or refuse it."""
        account = self.account(tenant)
        limit = self.limit_of(account)
        token_bucket = self._buckets(account, limit)[1] if _limited(limit) else None
        if token_bucket is None:
            return None
        wait = token_bucket.wait_s(tokens)
        if math.isinf(wait):
            return self._refused(account, Refusal(
                f"{describe(account, tenant)} may send at most {token_bucket.burst:.0f} tokens at once; this "
                f"request needs {tokens} (prompt + max_tokens)", 60.0))
        if wait > 0:
            return self._refused(account, Refusal(f"{describe(account, tenant)} is over its rate limit "
                                                  f"({_describe(limit)}); retry in {wait:.2f}s", wait))
        token_bucket.take(tokens)
        return None

    def check(self, tenant: str, tokens: int) -> Refusal | None:
        """`admit` and `charge` at once, for a request whose size is known up front."""
        return self.admit(tenant) or self.charge(tenant, tokens)

    def _refused(self, account: str, refusal: Refusal) -> Refusal:
        self.refused[account] = self.refused.get(account, 0) + 1
        return refusal

    def _buckets(self, account: str, limit: TenantLimit) -> tuple[TokenBucket | None, TokenBucket | None]:
        got = self.buckets.get(account)
        if got is None:
            if len(self.buckets) >= MAX_TENANTS:
                self.buckets.pop(next(iter(self.buckets)))   # oldest: a full bucket again is the lenient side
            got = self.buckets[account] = self._new(limit)
        return got

    def _new(self, limit: TenantLimit) -> tuple[TokenBucket | None, TokenBucket | None]:
        def bucket(rate: float) -> TokenBucket | None:
            return TokenBucket(rate, max(1.0, rate * limit.burst_s), self.clock) if rate > 0 else None
        return bucket(limit.requests_per_s), bucket(limit.tokens_per_s)


class ConcurrencyShares:
    """The global concurrency cap, shared fairly between accounts (TenantLimits.account). Non-blocking: a
    request over it is refused at once, never queued (docs/PROTOCOL.md "Limits, lifetimes and supervision").

    A request gets a slot when (1) the cap has one; (2) its account holds fewer than its own `max_concurrent`
    (tenants file; 0: none); (3) while the cap is contended - more than `contended` of it in flight with this
    request - its account holds less than an equal part of the cap, ceil(cap / n), among the n accounts that
    want slots: those with requests in flight, those refused a slot in the last `window_s`, and its own.
    So one tenant alone may fill the cap, but once another is refused for lack of room, the first may not take
    back the slots its requests free while it holds more than its part: the newcomer gets them, within about
    one of its retries. Requests in flight are never preempted.
    """

    def __init__(self, cap: int, limit_of: Callable[[str], int] = lambda account: 0,
                 contended: float = settings.FAIR_SHARE_CONTENDED, window_s: float = settings.FAIR_SHARE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cap = cap
        self.limit_of = limit_of              # an account's max_concurrent (0: none)
        self.contended = contended
        self.window_s = window_s
        self.clock = clock
        self.active = 0                       # in flight, all accounts
        self.held: dict[str, int] = {}        # account -> in flight (no entry at 0)
        self.wanting: dict[str, float] = {}   # account -> when it was last refused for lack of room

    def acquire(self, account: str, tenant: str = "") -> Refusal | None:
        """Take a slot for `account` (`tenant`: how the refusal names the caller), or say why not. No lock: the
        asyncio loop runs each call without interleaving."""
        held = self.held.get(account, 0)
        retry = settings.OVERLOAD_RETRY_AFTER_S
        if self.active >= self.cap:
            self.wanting[account] = self.clock()
            return Refusal(f"admission is at its limit of {self.cap} concurrent requests; retry in {retry:g} s",
                           retry, "overload")
        own = self.limit_of(account)
        if own and held >= own:
            return Refusal(f"{describe(account, tenant)} may have {own} requests in flight at once "
                           f"(max_concurrent in the tenants file) and has {held}; retry once one ends", retry,
                           "tenant_concurrency")
        if self.active + 1 > self.contended * self.cap:
            wanting = self._wanting(account)
            share = max(1, math.ceil(self.cap / wanting))
            if held >= share:
                return Refusal(f"admission's {self.cap} concurrent requests are contended by {wanting} tenants; "
                               f"{describe(account, tenant)} holds {held}, its equal part; retry in {retry:g} s",
                               retry, "fair_share")
        self.held[account] = held + 1
        self.active += 1
        return None

    def release(self, account: str) -> None:
        held = self.held.get(account, 0) - 1
        if held > 0:
            self.held[account] = held
        else:
            self.held.pop(account, None)
        self.active -= 1

    def _wanting(self, account: str) -> int:
        """Accounts wanting slots now, `account` included; forgets refusals older than the window."""
        horizon = self.clock() - self.window_s
        for stale in [a for a, at in self.wanting.items() if at < horizon]:
            del self.wanting[stale]
        return len(self.held.keys() | self.wanting.keys() | {account})


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


def _limit(section: dict, where: str, skip: frozenset[str] = frozenset(),
           base: TenantLimit = TenantLimit()) -> TenantLimit:
    """A table's limits over `base`; the keys in `skip` are someone else's to read (a tenant's API keys)."""
    if not isinstance(section, dict):
        raise ValueError(f"{where}: expected a table")
    fields = {f.name for f in dataclasses.fields(TenantLimit)}
    unknown = set(section) - fields - skip
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}")
    values: dict[str, Any] = {}   # each field's own type: float, or int for max_concurrent
    for key, value in section.items():
        if key in skip:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
        if key == "max_concurrent":
            if value != int(value):
                raise ValueError(f"{where}: max_concurrent must be a whole number, got {value!r}")
            values[key] = int(value)
        else:
            values[key] = float(value)
    if values.get("burst_s", 1.0) <= 0:
        raise ValueError(f"{where}: burst_s must be > 0")
    return dataclasses.replace(base, **values)


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
