"""Per-tenant token buckets, the tenants file, and shedding by priority and by deadline."""

import math

import pytest

from services.admission.limits import (TenantLimit, TenantLimits, TokenBucket, shed_by_deadline,
                                       shed_by_priority)
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
    lim = TenantLimits(TenantLimit(requests_per_s=2), {"vip": TenantLimit(requests_per_s=100)}, clock)
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
    lim = TenantLimits(TenantLimit(requests_per_s=1))
    for i in range(100):
        lim.check(f"t{i}", 1)
    assert len(lim.buckets) == 10


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
