"""Per-tenant token buckets, the anonymous account, each tenant's fair share of the concurrency cap, the
tenants file, and shedding by priority and by deadline."""

import math

import pytest

from services.admission.limits import (ANONYMOUS, ConcurrencyShares, TenantLimit, TenantLimits, TokenBucket,
                                       shed_by_deadline, shed_by_priority)
from tests.helpers import Clock


def test_bucket_refills_at_its_rate_up_to_its_burst():
    clock = Clock()
    b = TokenBucket(rate=10, burst=5, clock=clock)
    assert b.wait_s(5) == 0
    b.take(5)
    assert b.wait_s(1) == pytest.approx(0.1)
    clock.t = 10
    assert b.wait_s(5) == 0 and b.level == 5
    assert math.isinf(b.wait_s(6))


def test_a_tenant_over_its_bucket_is_refused_and_another_is_not():
    clock = Clock()
    default = TenantLimit(requests_per_s=2)
    lim = TenantLimits(default, {"a": default, "b": default, "vip": TenantLimit(requests_per_s=100)}, clock)
    assert lim.check("a", 10) is None and lim.check("a", 10) is None
    r = lim.check("a", 10)
    assert r is not None and 0 < r.retry_after_s <= 0.5 and "tenant a" in r.message
    assert lim.check("b", 10) is None              # its own bucket
    assert all(lim.check("vip", 10) is None for _ in range(50))
    clock.t = 0.5
    assert lim.check("a", 10) is None
    assert lim.refused == {"a": 1}


def test_token_rate_counts_prompt_plus_budget():
    clock = Clock()
    lim = TenantLimits(TenantLimit(tokens_per_s=1000), clock=clock)
    assert lim.check("t", 800) is None
    r = lim.check("t", 800)
    assert r is not None and r.retry_after_s == pytest.approx(0.6)
    too_big = lim.check("t", 5000)
    assert too_big is not None and "at most 1000 tokens at once" in too_big.message


def test_no_limits_configured_means_no_refusal():
    lim = TenantLimits()
    assert not lim.active
    assert all(lim.check(str(i), 10**6) is None for i in range(100))


def test_bucket_count_is_bounded(monkeypatch):
    import services.admission.limits as limits
    monkeypatch.setattr(limits, "MAX_TENANTS", 10)
    one = TenantLimit(requests_per_s=1)
    lim = TenantLimits(one, {f"t{i}": one for i in range(100)})
    for i in range(100):
        lim.check(f"t{i}", 1)
    assert len(lim.buckets) == 10


def test_tenants_the_file_does_not_name_share_one_anonymous_account():
    """Without API keys the body's tenant is the caller's claim: a new name per request must buy nothing."""
    clock = Clock()
    lim = TenantLimits(TenantLimit(requests_per_s=3), {"acme": TenantLimit(requests_per_s=3)}, clock)
    assert lim.account("acme") == "acme" and lim.account("x1") == lim.account("") == ANONYMOUS
    assert [lim.admit(f"fresh-{i}") is None for i in range(5)] == [True, True, True, False, False]
    refused = lim.admit("another-new-name")
    assert refused is not None and "shared by every tenant the tenants file does not name" in refused.message
    assert "another-new-name" in refused.message
    assert lim.admit("acme") is None                 # a named tenant keeps its own bucket
    assert set(lim.buckets) == {ANONYMOUS, "acme"} and lim.refused == {ANONYMOUS: 3}
    shares = ConcurrencyShares(4, contended=0.0)
    assert shares.acquire(lim.account("n1")) is None and shares.acquire(lim.account("n2")) is None
    assert shares.held == {ANONYMOUS: 2}             # minted names are one tenant for the fair share too


def test_admit_checks_before_any_work_and_charge_after_tokenizing():
    clock = Clock()
    lim = TenantLimits(TenantLimit(requests_per_s=2, tokens_per_s=100), clock=clock)
    assert lim.admit("t") is None                    # takes one request, no tokens yet
    assert lim.charge("t", 100) is None              # the whole token burst
    refused = lim.admit("t")                         # requests left, tokens spent: refused before any work
    assert refused is not None and refused.retry_after_s == pytest.approx(0.01)
    clock.t = 0.5
    assert lim.admit("t") is None and lim.charge("t", 60) is not None   # 50 tokens back: not enough for 60
    assert lim.charge("t", 50) is None
    assert TenantLimits().admit("anyone") is None    # no limits: nothing refused


def test_a_named_tenant_inherits_the_defaults_it_does_not_override(tmp_path):
    f = tmp_path / "tenants.toml"
    f.write_text('[defaults]\nrequests_per_s = 5\nmax_concurrent = 8\n[tenants.keyed]\napi_keys_sha256 = ["' + "0" * 64
                 + '"]\n[tenants.big]\nmax_concurrent = 100\n')
    lim = TenantLimits.from_file(f)
    assert lim.tenants["keyed"] == TenantLimit(requests_per_s=5, max_concurrent=8)
    assert lim.tenants["big"] == TenantLimit(requests_per_s=5, max_concurrent=100)
    f.write_text("[defaults]\nmax_concurrent = 1.5\n")
    with pytest.raises(ValueError, match="max_concurrent must be a whole number"):
        TenantLimits.from_file(f)


def test_a_tenant_alone_may_fill_the_cap():
    shares = ConcurrencyShares(10)
    assert all(shares.acquire("hog") is None for _ in range(10))
    full = shares.acquire("hog")
    assert full is not None and full.reason == "overload" and full.retry_after_s > 0


def test_a_newcomer_gets_the_slots_a_hog_frees():
    """The hog fills the cap alone; the newcomer is refused once (overload), which makes it a tenant wanting
    slots: from then on the hog may not take back what its requests free beyond its equal part."""
    clock = Clock()
    shares = ConcurrencyShares(10, clock=clock)
    for _ in range(10):
        assert shares.acquire("hog") is None
    assert shares.acquire("new").reason == "overload"
    shares.release("hog")
    again = shares.acquire("hog")                    # 9 held >= ceil(10 / 2): refused
    assert again is not None and again.reason == "fair_share" and "contended by 2 tenants" in again.message
    assert shares.acquire("new") is None             # the freed slot is the newcomer's
    for _ in range(4):                               # the hog's long requests end one by one
        shares.release("hog")
        assert shares.acquire("hog").reason == "fair_share"
        assert shares.acquire("new") is None
    assert shares.held == {"hog": 5, "new": 5}
    shares.release("hog")
    assert shares.acquire("hog") is None             # 4 < 5: the hog is within its part again


def test_the_newcomers_claim_lapses_with_the_window():
    clock = Clock()
    shares = ConcurrencyShares(4, window_s=5.0, clock=clock)
    for _ in range(4):
        shares.acquire("hog")
    assert shares.acquire("new").reason == "overload"
    shares.release("hog")
    assert shares.acquire("hog").reason == "fair_share"
    clock.t = 6.0                                    # the newcomer never came back
    assert shares.acquire("hog") is None and shares.wanting == {}


def test_no_fair_share_below_the_contended_level_and_a_tenants_own_limit():
    shares = ConcurrencyShares(10, limit_of=lambda account: 2 if account == "small" else 0)
    assert shares.acquire("a") is None and shares.acquire("b") is None
    assert shares.acquire("small") is None and shares.acquire("small") is None
    own = shares.acquire("small")
    assert own is not None and own.reason == "tenant_concurrency"
    assert "may have 2 requests in flight" in own.message
    for _ in range(3):                               # 7 in flight: contended, 3 wanting, each may hold 4
        assert shares.acquire("a") is None
    assert shares.acquire("a").reason == "fair_share"
    assert shares.acquire("b") is None
    shares.release("a")
    shares.release("small")
    assert shares.held == {"a": 3, "b": 2, "small": 1} and shares.active == 6


def test_tenants_file(tmp_path):
    f = tmp_path / "tenants.toml"
    f.write_text('[defaults]\nrequests_per_s = 5\n[tenants.acme]\nrequests_per_s = 50\ntokens_per_s = 1e5\nburst_s = 2\n')
    lim = TenantLimits.from_file(f)
    assert lim.defaults == TenantLimit(requests_per_s=5)
    assert lim.tenants["acme"] == TenantLimit(50, 1e5, 2)
    for bad, why in [("[tenant.x]\n", "unknown section"), ("[defaults]\nrps = 1\n", "unknown key"),
                     ("[defaults]\nrequests_per_s = -1\n", ">= 0"), ("[defaults]\nrequests_per_s = 'x'\n", ">= 0"),
                     ("[defaults\n", "tenants.toml")]:
        f.write_text(bad)
        with pytest.raises(ValueError, match=why):
            TenantLimits.from_file(f)


def test_shed_by_priority_keeps_headroom_for_higher_priorities():
    cap = 100
    assert shed_by_priority("sheddable", 69, cap) is None
    assert shed_by_priority("sheddable", 70, cap) is not None
    assert shed_by_priority("standard", 70, cap) is None
    assert shed_by_priority("standard", 90, cap) is not None
    assert shed_by_priority("critical", 99, cap) is None
    assert shed_by_priority("critical", 100, cap) is not None
    # small caps: every priority may have at least one slot, standard the whole of a cap of 2
    assert shed_by_priority("standard", 1, 2) is None and shed_by_priority("sheddable", 0, 2) is None
    assert shed_by_priority("sheddable", 1, 2) is not None


def test_shed_by_deadline():
    assert shed_by_deadline(2.0, None) is None
    assert shed_by_deadline(2.0, 3.0) is None
    r = shed_by_deadline(4.0, 3.0)
    assert r is not None and "exceeds" in r.message
