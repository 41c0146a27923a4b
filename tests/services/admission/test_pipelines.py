"""The pipelines' pure parts: the coordinators flag, the prefix key, a link's reading of load reports, the
choice with shedding and breakers (links built without a server: no call is made until a request starts)."""

import asyncio

import grpc
import pytest

from services.admission.pipelines import (PREFIX_TOKENS, Pipelines, Refused, parse_coordinators, routing_key)
from services.admission.routing import RouteRequest
from tether.model import dtypes
from tether.v1 import coordinator_pb2


def test_parse_coordinators():
    assert parse_coordinators("127.0.0.1:1, h:2=long, h:3=short+medium") == [
        ("127.0.0.1:1", frozenset()), ("h:2", frozenset({"long"})), ("h:3", frozenset({"short", "medium"}))]
    for bad in ["", "h", "h:1=huge", "h:1,h:1"]:
        with pytest.raises(ValueError):
            parse_coordinators(bad)


def test_routing_key_follows_system_prompt_or_first_block_and_tenant():
    ids = list(range(200))
    assert routing_key(ids[:PREFIX_TOKENS - 1], 0, "a") == 0           # shorter than a block: no key
    k = routing_key(ids, 0, "a")
    assert k and k == routing_key(ids[:PREFIX_TOKENS] + [9, 9], 0, "a")   # same first block, same key
    assert k != routing_key(ids, 0, "b")                                  # tenants never share
    assert k != routing_key([1] + ids[1:], 0, "a")
    assert routing_key([1, 2], 77, "a") == routing_key([3], 77, "a") != routing_key([3], 78, "a")


def report(**kw):
    base = dict(serving=True, status="serving", model_fingerprint="fp", max_context=2048, kv_blocks_total=64,
                kv_blocks_free=64, kv_block_tokens=64, step_seconds=0.05, max_batch_slots=32, max_batch_tokens=512)
    base.update(kw)
    return coordinator_pb2.LoadReport(**base)


def make(n=2):
    async def build():
        return Pipelines([(f"127.0.0.1:{9 + i}", frozenset()) for i in range(n)], "fp", lambda stub: None)
    return asyncio.run(build())


def test_a_link_serves_only_its_model_and_only_while_reported_serving():
    p = make(1)
    (link,) = p.links.values()
    assert not p.ready()[0] and "no load report" in p.ready()[1]
    link.report(report())
    assert p.ready()[0]
    link.report(report(model_fingerprint="other"))
    assert not link.serving and "serves model other" in link.reason
    link.report(report(serving=False, status="recovering: stage down"))
    assert not p.ready()[0] and "recovering: stage down" in p.ready()[1]


def test_a_link_names_the_numerics_its_coordinator_reports_in_receipts():
    p = make(1)
    (link,) = p.links.values()
    link.report(report(model_fingerprint="fp-bfloat16"))   # the model's fingerprint and the stages' dtype
    assert link.serving and link.served_fingerprint == "fp-bfloat16"
    link.report(report(model_fingerprint="other-bfloat16"))
    assert not link.serving and link.served_fingerprint == ""
    served = dtypes.served_fingerprint("fp", "float32", "unpadded, at least 1 rows, rowdot linears")
    link.report(report(model_fingerprint=served))     # and a digest of the kernels the stages' probe chose
    assert link.serving and link.served_fingerprint == served


def test_the_served_fingerprint_names_model_dtype_and_kernels():
    rowdot = dtypes.served_fingerprint("ab12", "float32", "unpadded, at least 1 rows, rowdot linears")
    padded = dtypes.served_fingerprint("ab12", "float32", "padded to 4 rows per thread")
    assert rowdot.startswith("ab12-float32-") and len(rowdot.split("-")[2]) == 8
    assert rowdot != padded                                   # other kernels, other bits: another name
    assert dtypes.served_fingerprint("ab12", "float32") == "ab12-float32"   # a coordinator not yet handshaken
    assert {dtypes.model_part(f) for f in (rowdot, padded, "ab12-float32")} == {"ab12"}


def test_choose_spreads_by_predicted_cost_and_counts_outstanding_work():
    p = make(2)
    for link in p.links.values():
        link.report(report())
    req = RouteRequest(prompt_tokens=32, max_tokens=16)
    a = p.choose(req, None)
    b = p.choose(req, None)
    assert a.link is not b.link                       # the first one's outstanding work counts at once
    p.finished(a, None)
    p.finished(b, None)
    assert all(l.outstanding == 0 and l.in_flight == 0 for l in p.links.values())


def test_refusals_none_serving_too_big_and_past_deadline():
    p = make(1)
    (link,) = p.links.values()
    with pytest.raises(Refused) as e:
        p.choose(RouteRequest(32, 16), None)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.retry_after_s > 0
    link.report(report(max_context=64))
    with pytest.raises(Refused) as e:
        p.choose(RouteRequest(100, 16), None)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.retry_after_s is None
    link.report(report(kv_blocks_total=1))
    with pytest.raises(Refused) as e:
        p.choose(RouteRequest(100, 16), None)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.retry_after_s is None
    link.report(report(step_seconds=1.0, waiting=320))
    with pytest.raises(Refused) as e:
        p.choose(RouteRequest(32, 16), deadline_s=2.0)   # 10 steps queued ahead at 1 s each
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "deadline" in e.value.message
    assert p.choose(RouteRequest(32, 16), deadline_s=60.0).link is link


def test_failures_open_the_breaker_and_traffic_moves():
    p = make(2)
    bad, good = p.links.values()
    bad.report(report())
    good.report(report(serving=False))
    for _ in range(bad.breaker.failure_threshold):
        r = p.choose(RouteRequest(32, 16), None)
        assert r.link is bad
        p.finished(r, grpc.StatusCode.UNAVAILABLE)
    assert bad.breaker.state == "open" and bad.in_flight == 0 and bad.outstanding == 0
    with pytest.raises(Refused) as e:                 # its report still says serving: the breaker rules
        p.choose(RouteRequest(32, 16), None)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.retry_after_s > 0
    good.report(report())
    assert all(p.choose(RouteRequest(32, 16), None).link is good for _ in range(5))
    # a cancelled request says nothing about the pipeline
    r = p.choose(RouteRequest(32, 16), None)
    p.finished(r, grpc.StatusCode.CANCELLED)
    assert good.breaker.failures == 0


def test_pipelines_collector_shows_each_pipeline_and_its_breaker():
    from prometheus_client import CollectorRegistry, generate_latest

    from tether.telemetry.metrics import PipelinesCollector

    p = make(2)
    a, b = p.links.values()
    a.report(report())
    b.down("coordinator unreachable")
    registry = CollectorRegistry()
    registry.register(PipelinesCollector(p))
    text = generate_latest(registry).decode()
    assert f'tether:pipeline_up{{pipeline="{a.address}"}} 1.0' in text
    assert f'tether:pipeline_up{{pipeline="{b.address}"}} 0.0' in text
    assert f'tether:pipeline_breaker_state{{pipeline="{b.address}",state="open"}} 1.0' in text
    assert f'tether:pipeline_breaker_opens_total{{pipeline="{b.address}"}} 1.0' in text


def test_dns_names_are_followed_as_pipelines_come_and_go():
    """`dns:NAME:PORT`: every resolved address is a pipeline; one that stops resolving takes no new request and
    is closed once its last request ended; a failed lookup changes nothing."""
    answers = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"], OSError("no such host")]

    async def resolve(host, port):
        assert (host, port) == ("coordinators.ns.svc", 50061)
        answer = answers.pop(0) if answers else OSError("still failing")
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def run():
        p = Pipelines(parse_coordinators("dns:coordinators.ns.svc:50061=long,127.0.0.1:9"), "fp", lambda stub: None)
        assert set(p.links) == {"127.0.0.1:9"}
        task = asyncio.create_task(p.discover(resolve, interval_s=0.01))
        while "10.0.0.1:50061" not in p.links:
            await asyncio.sleep(0.001)
        assert set(p.links) == {"127.0.0.1:9", "10.0.0.1:50061", "10.0.0.2:50061"}
        assert p.links["10.0.0.1:50061"].load.roles == {"long"}
        gone = p.links["10.0.0.1:50061"]
        gone.report(report())
        held = p.choose(RouteRequest(32, 16, size_class="long"), None)   # a request in flight on it
        assert held.link is gone
        while "10.0.0.3:50061" not in p.links:
            await asyncio.sleep(0.001)
        while answers:                                     # the failed lookup: nothing changes
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        assert set(p.links) == {"127.0.0.1:9", "10.0.0.2:50061", "10.0.0.3:50061"}   # the static one stays
        assert "10.0.0.1:50061" in p.retired                # draining: its request still runs
        p.finished(held, None)
        assert "10.0.0.1:50061" not in p.retired
        task.cancel()
        await p.close()

    asyncio.run(run())


def test_a_cancelled_probe_does_not_leave_the_breaker_stuck_half_open():
    p = make(1)
    (link,) = p.links.values()
    link.report(report())
    link.breaker.clock = lambda: 0.0
    link.breaker.trip()
    link.breaker.clock = lambda: 100.0                     # past the open wait: half-open, one probe
    probe = p.choose(RouteRequest(32, 16), None)
    with pytest.raises(Refused):
        p.choose(RouteRequest(32, 16), None)               # the probe slot is taken
    p.finished(probe, grpc.StatusCode.CANCELLED)
    assert p.choose(RouteRequest(32, 16), None).link is link
