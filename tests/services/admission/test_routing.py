"""The router on synthetic load snapshots: filters, each scorer, the policies, prefix affinity."""

import dataclasses

import pytest

from services.admission.routing import (Candidate, NoPipeline, PipelineLoad, RouteRequest, Router, capacity_score,
                                        kv_score, predicted_wait_s, prefix_score, queue_score, role_score)


def load(name, **kw):
    base = dict(serving=True, max_context=2048, kv_blocks_total=128, kv_blocks_free=128)
    base.update(kw)
    return PipelineLoad(name, **base)


SHORT = RouteRequest(prompt_tokens=32, max_tokens=16, size_class="short")
LONG = RouteRequest(prompt_tokens=1500, max_tokens=256, size_class="long")


def route(router, req, loads, outstanding=None, in_flight=None, allowed=lambda n: True):
    return router.route(req, loads, outstanding or {}, in_flight or {}, allowed)


def test_filters_context_limit_and_kv_capacity():
    r = Router()
    small = load("a", max_context=512)
    tiny_pool = load("b", kv_blocks_total=4)      # 4 blocks of 64 = 256 positions
    big = load("c")
    assert route(r, LONG, [small, tiny_pool, big]).pipeline == "c"
    with pytest.raises(NoPipeline) as e:
        route(r, LONG, [small, tiny_pool])
    assert not e.value.retryable and not e.value.kv and "1755 context positions" in str(e.value)
    with pytest.raises(NoPipeline) as e:
        route(r, LONG, [tiny_pool])
    assert not e.value.retryable and e.value.kv and "hold at most 256" in str(e.value)


def test_down_or_broken_pipelines_are_skipped_and_all_down_is_retryable():
    r = Router()
    loads = [load("a", serving=False), load("b")]
    assert route(r, SHORT, loads).pipeline == "b"
    assert route(r, SHORT, [load("a"), load("b")], allowed=lambda n: n != "a").pipeline == "b"
    with pytest.raises(NoPipeline) as e:
        route(r, SHORT, [load("a", serving=False)], allowed=lambda n: True)
    assert e.value.retryable


def test_capacity_scorer_prefers_less_backlog_and_sees_local_outstanding_work():
    idle = Candidate(load("a"))
    busy = Candidate(load("b", work=10_000))
    sent_here = Candidate(load("c"), outstanding=10_000)   # the report lags; what we sent is known now
    assert capacity_score(idle, SHORT) == 1.0
    assert capacity_score(busy, SHORT) < 0.05
    assert capacity_score(sent_here, SHORT) == capacity_score(busy, SHORT)
    # the router follows it
    assert route(Router(), SHORT, [load("a", work=5_000), load("b", work=100)]).pipeline == "b"
    assert route(Router(), SHORT, [load("a"), load("b")], outstanding={"a": 5_000}).pipeline == "b"


def test_kv_queue_role_and_prefix_scorers():
    assert kv_score(Candidate(load("a", kv_blocks_free=100)), SHORT) > kv_score(Candidate(load("a", kv_blocks_free=10)), SHORT)
    assert kv_score(Candidate(load("a", kv_blocks_free=0)), SHORT) == 0.0
    assert queue_score(Candidate(load("a")), SHORT) == 1.0
    assert queue_score(Candidate(load("a", waiting=9)), SHORT) == pytest.approx(0.1)
    assert role_score(Candidate(load("a", roles=frozenset({"long"}))), LONG) == 1.0
    assert role_score(Candidate(load("a")), LONG) == 0.0
    assert prefix_score(Candidate(load("a"), prefix_hit=True), SHORT) == 1.0


def test_roles_send_long_requests_to_long_pipelines_and_short_elsewhere():
    loads = [load("long", roles=frozenset({"long"})), load("short", roles=frozenset({"short", "medium"}))]
    r = Router()
    assert route(r, LONG, loads).pipeline == "long"
    assert route(r, SHORT, loads).pipeline == "short"
    # the role's pipeline down: any live pipeline that can hold it serves rather than nobody
    assert route(r, LONG, [dataclasses.replace(loads[0], serving=False), loads[1]]).pipeline == "short"


def test_prefix_affinity_follows_the_prefix_until_the_cache_is_forgotten():
    r = Router()
    req = RouteRequest(prompt_tokens=600, max_tokens=16, prefix_key=0xABC)
    loads = [load("a"), load("b")]
    first = route(r, req, loads).pipeline
    other = "b" if first == "a" else "a"
    # the other pipeline is now a little less loaded: affinity still wins
    busier = [load(first, work=400), load(other, work=0)]
    assert route(r, req, busier).pipeline == first
    # ... but not when the affine pipeline is swamped
    assert route(r, req, [load(first, work=100_000), load(other)]).pipeline == other
    # a coordinator that forgot its cache mirror (generation bumped) is no longer affine
    r2 = Router()
    route(r2, req, [load("a", work=0), load("b", work=10)])
    d = route(r2, req, [load("a", cache_generation=1, work=400), load("b", work=0)])
    assert d.pipeline == "b"


def test_a_prefix_both_pipelines_hold_biases_neither():
    r = Router()
    req = RouteRequest(prompt_tokens=600, max_tokens=16, prefix_key=7)
    route(r, req, [load("a"), load("b", work=10_000)])     # to a
    route(r, req, [load("a", work=10_000), load("b")])     # to b: both now hold it
    assert r.affinity.lookup(7, {"a": load("a"), "b": load("b")}) == {"a", "b"}
    # with both affine, the less loaded one takes it, even by a margin affinity alone would have overridden
    assert route(r, req, [load("a", work=400), load("b", work=0)]).pipeline == "b"


def test_affinity_memory_is_bounded():
    r = Router()
    r.affinity.capacity = 8
    for k in range(1, 100):
        route(r, RouteRequest(32, 16, prefix_key=k), [load("a")])
    assert len(r.affinity.entries) == 8


def test_round_robin_and_least_loaded_stay_selectable():
    loads = [load("a"), load("b"), load("c")]
    rr = Router("round-robin")
    assert [route(rr, SHORT, loads).pipeline for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    ll = Router("least-loaded")
    assert route(ll, SHORT, [load("a", running=5), load("b", running=1, waiting=1), load("c", running=3)]).pipeline == "b"
    assert route(ll, SHORT, [load("a"), load("b")], in_flight={"a": 3}).pipeline == "b"
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router("random")
    with pytest.raises(ValueError, match="unknown scorer"):
        Router(weights={"vibes": 1.0})


def test_decision_says_why():
    d = route(Router(), SHORT, [load("a"), load("b", work=1000)])
    assert d.pipeline == "a" and d.policy == "features" and "capacity" in d.reason
    assert {name for name, _ in d.scores} == {"capacity", "kv", "queue", "prefix", "role"}


def test_predicted_wait():
    p = load("a", step_seconds=0.1, waiting=64)
    assert predicted_wait_s(load("a"), 0, SHORT, 32, 512) == 0.0       # nothing reported yet
    assert predicted_wait_s(p, 0, SHORT, 32, 512) == pytest.approx(0.1 * (1 + 2 + 1))
    assert predicted_wait_s(p, 0, LONG, 32, 512) == pytest.approx(0.1 * (1 + 2 + 3))
