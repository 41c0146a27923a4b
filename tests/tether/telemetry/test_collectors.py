"""The collectors map the services' Stats messages to metrics; the request timers observe what they are told."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tether.telemetry import metrics
from tether.v1 import coordinator_pb2, stage_pb2


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_coordinator_collector_maps_the_stats_reply():
    reply = coordinator_pb2.StatsReply(
        serving=True, running=3, waiting=2, preempted=1, kv_blocks_used=10, kv_blocks_cached=4, kv_blocks_total=64,
        prefix_queries=8, prefix_hits=6, prefix_hit_tokens=384, prefix_misses=1, prompt_tokens=900,
        computed_tokens=700, tokens_generated=55, requests_finished=7, requests_failed=2, rebuilds=3, resumes=2,
        recovered=4, pipeline_reconnects=1, preemptions=5, step_seconds=0.02,
        rejections={"STALE_EPOCH": 2, "FRAME_LOST": 1}, faults_injected={"drop": 9})
    registry = CollectorRegistry()
    registry.register(metrics.CoordinatorCollector(lambda: reply))
    s = samples(registry)
    assert s[("tether:num_requests_running", ())] == 3
    assert s[("tether:num_requests_waiting", ())] == 2
    assert s[("tether:num_requests_preempted", ())] == 1
    assert s[("tether:kv_blocks_used", ())] == 10
    assert s[("tether:kv_blocks_total", ())] == 64
    assert s[("tether:prefix_cache_hit_rate", ())] == pytest.approx(0.75)
    assert s[("tether:prefix_cache_hit_tokens_total", ())] == 384
    assert s[("tether:engine_generation_tokens_total", ())] == 55
    assert s[("tether:rebuilds_total", ())] == 3
    assert s[("tether:resumes_total", ())] == 2
    assert s[("tether:recovered_requests_total", ())] == 4
    assert s[("tether:integrity_rejections_total", (("reason", "STALE_EPOCH"),))] == 2
    assert s[("tether:integrity_rejections_total", (("reason", "FRAME_LOST"),))] == 1
    assert s[("tether:faults_injected_total", (("kind", "drop"),))] == 9
    assert s[("tether:pipeline_serving", ())] == 1


def test_hit_rate_is_zero_before_any_query():
    registry = CollectorRegistry()
    registry.register(metrics.CoordinatorCollector(lambda: coordinator_pb2.StatsReply()))
    registry.register(metrics.StageCollector(lambda: stage_pb2.StageStats()))
    s = samples(registry)
    assert s[("tether:prefix_cache_hit_rate", ())] == 0
    assert s[("tether:stage_prefix_cache_hit_rate", ())] == 0


def test_stage_collector_maps_the_stage_stats():
    stats = stage_pb2.StageStats(requests_held=2, kv_blocks_used=5, kv_blocks_cached=3, kv_blocks_total=100,
                                 kv_used_tokens=300, kv_capacity_tokens=6400, busy_seconds=1.5, steps=40,
                                 prefix_queries=4, prefix_hits=1, rejections={"CONTEXT_HASH_MISMATCH": 3},
                                 refusals={"FRAME_ROWS": 1}, forward_streams=1, kv_blocks_touched=7,
                                 kv_block_bytes=4096)
    registry = CollectorRegistry()
    registry.register(metrics.StageCollector(lambda: stats))
    s = samples(registry)
    assert s[("tether:stage_requests_held", ())] == 2
    assert s[("tether:stage_kv_blocks_total", ())] == 100
    assert s[("tether:stage_kv_pool_bytes", ())] == 100 * 4096
    assert s[("tether:stage_kv_resident_bytes", ())] == 7 * 4096
    assert s[("tether:stage_busy_seconds_total", ())] == 1.5
    assert s[("tether:stage_steps_total", ())] == 40
    assert s[("tether:stage_prefix_cache_hit_rate", ())] == 0.25
    assert s[("tether:stage_rejections_total", (("reason", "CONTEXT_HASH_MISMATCH"),))] == 3
    assert s[("tether:stage_refusals_total", (("limit", "FRAME_ROWS"),))] == 1


def test_collectors_read_every_scrape_afresh():
    reply = coordinator_pb2.StatsReply(running=1)
    registry = CollectorRegistry()
    registry.register(metrics.CoordinatorCollector(lambda: reply))
    assert samples(registry)[("tether:num_requests_running", ())] == 1
    reply.running = 7
    assert samples(registry)[("tether:num_requests_running", ())] == 7


def test_request_timer_observes_ttft_itl_e2e_and_tokens():
    registry = CollectorRegistry()
    m = metrics.AdmissionMetrics(registry, in_flight=lambda: 3, max_concurrent=10, ready=lambda: True)
    t = m.start("acme", prompt_tokens=11, arrived=100.0)
    for now in (100.5, 100.6, 100.8):
        t.token(now)
    t.finished("length", 101.0)
    t2 = m.start("", prompt_tokens=4, arrived=200.0)
    t2.token(200.25)
    t2.failed("DEADLINE_EXCEEDED")
    s = samples(registry)
    assert s[("tether:time_to_first_token_seconds_count", ())] == 2
    assert s[("tether:time_to_first_token_seconds_sum", ())] == pytest.approx(0.75)
    assert s[("tether:inter_token_latency_seconds_count", ())] == 2
    assert s[("tether:inter_token_latency_seconds_sum", ())] == pytest.approx(0.3)
    assert s[("tether:e2e_request_latency_seconds_count", ())] == 1     # a failed request has no e2e latency
    assert s[("tether:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.0)
    assert s[("tether:prompt_tokens_total", ())] == 15
    assert s[("tether:generation_tokens_total", ())] == 4                # tokens the clients received
    assert s[("tether:requests_total", (("tenant", "acme"),))] == 1
    assert s[("tether:requests_total", (("tenant", "(default)"),))] == 1
    assert s[("tether:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("tether:request_failures_total", (("code", "DEADLINE_EXCEEDED"),))] == 1
    assert s[("tether:admission_requests_in_flight", ())] == 3
    assert s[("tether:admission_max_concurrent", ())] == 10
    assert s[("tether:admission_ready", ())] == 1
    # the histogram's buckets are cumulative: 0.5 s TTFT is under le=0.5, 0.25 s too
    assert s[("tether:time_to_first_token_seconds_bucket", (("le", "0.5"),))] == 2
    assert s[("tether:time_to_first_token_seconds_bucket", (("le", "0.25"),))] == 1


def test_tenant_labels_are_bounded():
    registry = CollectorRegistry()
    m = metrics.AdmissionMetrics(registry, max_tenants=2)
    for tenant in ("a", "b", "c", "d", "a"):
        m.start(tenant, 1, 0.0)
    s = samples(registry)
    assert s[("tether:requests_total", (("tenant", "a"),))] == 2
    assert s[("tether:requests_total", (("tenant", "b"),))] == 1
    assert s[("tether:requests_total", (("tenant", "_other"),))] == 2
    assert ("tether:requests_total", (("tenant", "c"),)) not in s


def test_queue_time_is_observed_once_per_request_at_its_first_frame():
    registry = CollectorRegistry()
    m = metrics.CoordinatorMetrics(registry)
    a, b = SimpleNamespace(id="a"), SimpleNamespace(id="b")
    m.submitted("a")
    m.submitted("b")
    m.on_batch([a])
    m.on_batch([a, b])      # a's second frame (decode, or after a rebuild): not queue time again
    m.on_batch([b])
    s = samples(registry)
    assert s[("tether:request_queue_time_seconds_count", ())] == 2
    m.submitted("c")
    m.ended("c", "UNAVAILABLE")   # failed before its first frame: forgotten, never observed
    m.ended("d", "ABORTED")
    m.ended("e", None)
    m.on_batch([SimpleNamespace(id="c")])
    s = samples(registry)
    assert s[("tether:request_queue_time_seconds_count", ())] == 2
    assert not m.pending
    assert s[("tether:failed_recoveries_total", (("reason", "pipeline_down"),))] == 1
    assert s[("tether:failed_recoveries_total", (("reason", "rebuild_budget"),))] == 1
    assert s[("tether:engine_request_failures_total", (("code", "ABORTED"),))] == 1


def test_snapshot_runs_on_the_owning_loop_and_is_served_over_http():
    """The collector's snapshot is taken on the loop thread (where the state lives), from the HTTP thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    seen = []

    def snapshot() -> stage_pb2.StageStats:
        seen.append(threading.current_thread() is thread)
        return stage_pb2.StageStats(steps=12)

    try:
        registry = metrics.new_registry()
        registry.register(metrics.StageCollector(lambda: metrics.on_loop(loop, snapshot)))
        port = metrics.serve(registry, "127.0.0.1", 0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "tether:stage_steps_total 12.0" in text
        assert "process_cpu_seconds_total" in text
        assert seen == [True]
        with pytest.raises(OSError, match="--metrics-port"):   # the port is taken: a clear error
            metrics.serve(registry, "127.0.0.1", port)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_metric_names_lists_every_family():
    names = metrics.metric_names()
    for h in metrics.HISTOGRAMS:
        assert {f"tether:{h}_bucket", f"tether:{h}_sum", f"tether:{h}_count"} <= names
    assert {"tether:num_requests_running", "tether:num_requests_waiting", "tether:kv_blocks_used",
            "tether:kv_blocks_total", "tether:prefix_cache_hit_rate", "tether:prompt_tokens_total",
            "tether:generation_tokens_total", "tether:integrity_rejections_total", "tether:rebuilds_total",
            "tether:resumes_total", "tether:failed_recoveries_total", "tether:requests_shed_total",
            "tether:requests_total"} <= names
    assert all(n.startswith("tether:") for n in names)
