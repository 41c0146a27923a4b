"""Prometheus metrics of every service: names, collectors, the /metrics endpoint.

Names follow vLLM's (`vllm:time_to_first_token_seconds` ...) with a `tether:` prefix, so dashboards and habits
carry over. Two kinds of source, chosen so the serving hot path does no extra work:

- Figures each service already keeps for its gRPC `Stats` reply (the coordinator's engine counters, scheduler
  figures and block ledger; a stage's worker counters and KV pool) are read at scrape time by a custom
  collector from the very `Stats` message the service builds (`CoordinatorCollector`, `StageCollector`): one
  source of truth, and nothing is counted twice.
- Per-request latencies are histograms observed where the request's tokens are already seen: admission
  (`AdmissionMetrics`: time to first token, inter-token latency, end-to-end) and the coordinator's scheduler
  boundary (`CoordinatorMetrics`: queue time, through Driver.on_batch).

Collection runs on a thread of the /metrics server (metrics_http.py: a bounded number of them). A snapshot of
state owned by an asyncio loop is taken on that loop (`on_loop`), never read from the HTTP thread while the
loop mutates it, and at most once per METRICS_SNAPSHOT_MAX_AGE_S however many scrapes ask (`CachedSnapshot`):
a stage's Stats runs on its model thread, and a scrape flood must not queue work there.

Every metric name is in METRIC_NAMES; tests hold the Grafana dashboard and the docs to that list.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tether import ports, settings

log = logging.getLogger(__name__)
T = TypeVar("T")

PREFIX = "tether:"
SCRAPE_TIMEOUT_S = 5.0   # a snapshot the owning loop has not taken by then fails the scrape (Prometheus: up=0)

# Buckets as vLLM's, with finer low ends for the inter-token latency (a CPU pipeline step is milliseconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


def new_registry() -> CollectorRegistry:
    """A registry of this process's own (not the library's global one, so tests can hold several), with the
    standard process metrics (CPU seconds, resident memory, open files) and the servers its channels refused
    (every service opens channels to others)."""
    prometheus_client.disable_created_metrics()   # `_created` series double every counter for nothing here
    registry = CollectorRegistry()
    prometheus_client.ProcessCollector(registry=registry)
    registry.register(ServerIdentityCollector())
    return registry


def serve(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve `registry` as /metrics on host:port (0 picks a free port) from a daemon thread; returns the port."""
    from tether.telemetry import metrics_http
    try:
        server = metrics_http.start(registry, host, port)
    except OSError as e:
        raise ports.bind_error(host, port, "--metrics-port", e) from e
    return server.server_address[1]


class CachedSnapshot(Generic[T]):
    """`fetch()` at most once per `max_age_s`, however many callers ask: a caller within that age of the last
    fetch gets its result, and callers arriving during a fetch wait for that one fetch (one at a time) rather
    than starting their own. A failed fetch is not cached (the next caller tries again)."""

    def __init__(self, fetch: Callable[[], T], max_age_s: float = settings.METRICS_SNAPSHOT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fetch, self.max_age_s, self.clock = fetch, max_age_s, clock
        self.fetches = 0
        self._lock = threading.Lock()
        self._value: T | None = None
        self._at = -math.inf

    def __call__(self) -> T:
        with self._lock:
            if self._value is None or self.clock() - self._at >= self.max_age_s:
                self._value = self.fetch()
                self.fetches += 1
                self._at = self.clock()
            return self._value


def loop_snapshot(loop: asyncio.AbstractEventLoop, fn: Callable[[], T],
                  max_age_s: float = settings.METRICS_SNAPSHOT_MAX_AGE_S) -> CachedSnapshot[T]:
    """What a Stats collector reads: `fn` run on `loop` (which owns the state), at most once per `max_age_s`."""
    return CachedSnapshot(lambda: on_loop(loop, fn), max_age_s)


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T], timeout: float = SCRAPE_TIMEOUT_S) -> T:
    """Run `fn` on `loop` (which owns the state it reads) and wait for its result from another thread."""
    async def call() -> T:
        result = fn()
        if asyncio.iscoroutine(result):
            result = await result
        return result
    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout)


# ------------------------------------------------------------------------------------- mapping Stats messages

def _gauge(name: str, help_: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_, value=value)


def _counter(name: str, help_: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, help_, value=value)


def _labelled(name: str, help_: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, help_, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


class _StatsCollector(Collector):
    """Maps the Stats message `snapshot()` returns to metric families at every scrape."""

    def __init__(self, snapshot: Callable[[], object]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from self.families(self.snapshot())

    def families(self, stats) -> Iterable[Metric]:   # pragma: no cover - overridden
        raise NotImplementedError


class CoordinatorCollector(_StatsCollector):
    """The coordinator's engine, from its `coordinator_pb2.StatsReply`."""

    def families(self, s) -> Iterable[Metric]:
        yield _gauge("pipeline_serving", "1 while the coordinator's pipeline is assembled and serving", s.serving)
        yield _gauge("num_requests_running", "Requests in the running set (holding KV blocks on the stages)",
                     s.running)
        yield _gauge("num_requests_waiting", "Requests waiting to start (including preempted ones)", s.waiting)
        yield _gauge("num_requests_preempted", "Waiting requests that were preempted and will be recomputed",
                     s.preempted)
        yield _gauge("kv_blocks_used", "KV blocks held by requests (the coordinator's ledger of every stage)",
                     s.kv_blocks_used)
        yield _gauge("kv_blocks_cached", "KV blocks nobody holds, kept for prefix hits (evictable)",
                     s.kv_blocks_cached)
        yield _gauge("kv_blocks_total", "KV blocks in the route's pool (the smallest stage's)", s.kv_blocks_total)
        yield _gauge("prefix_cache_hit_rate", "Requests started from a cached prefix / requests that consulted "
                     "the prefix cache, since start", _ratio(s.prefix_hits, s.prefix_queries))
        yield _gauge("engine_step_seconds", "Recent mean time from a frame's send to its reply", s.step_seconds)
        yield _counter("prefix_cache_queries", "Requests started with the prefix cache consulted", s.prefix_queries)
        yield _counter("prefix_cache_hits", "Requests started with a cached prefix", s.prefix_hits)
        yield _counter("prefix_cache_hit_tokens", "Context positions taken from the prefix cache instead of "
                       "computed", s.prefix_hit_tokens)
        yield _counter("prefix_cache_misses", "Cached prefixes a stage could not confirm (replayed cold)",
                       s.prefix_misses)
        yield _counter("engine_prompt_tokens", "Context tokens of requests started, restarts after a preemption "
                       "included", s.prompt_tokens)
        yield _counter("engine_computed_tokens", "Context positions the stages computed (prefill and decode rows)",
                       s.computed_tokens)
        yield _counter("engine_generation_tokens", "Tokens appended after their stamps checked", s.tokens_generated)
        yield _counter("engine_requests_finished", "Requests the engine finished", s.requests_finished)
        yield _counter("engine_requests_failed", "Requests the engine failed explicitly", s.requests_failed)
        yield _labelled("integrity_rejections", "Slots whose state could not be verified, by reason (stage "
                        "RejectReason names, ECHO_MISMATCH, TOKEN_HASH_MISMATCH, FRAME_LOST, STATE_LOST, "
                        "PREFIX_MISS)", "reason", dict(s.rejections))
        yield _counter("rebuilds", "Request states replayed from position 0 under a new epoch", s.rebuilds)
        yield _counter("resumes", "Requests resumed after a sync found every stage consistent", s.resumes)
        yield _counter("recovered_requests", "Requests that finished after at least one rebuild or resume",
                       s.recovered)
        yield _counter("pipeline_reconnects", "Times the pipeline was re-handshaken after breaking",
                       s.pipeline_reconnects)
        yield _counter("preemptions", "Requests preempted to free KV blocks", s.preemptions)
        yield _labelled("faults_injected", "Faults this process injected (experiments only), by kind", "kind",
                        dict(s.faults_injected))


class StageCollector(_StatsCollector):
    """One stage worker, from its `stage_pb2.StageStats`."""

    def families(self, s) -> Iterable[Metric]:
        yield _gauge("stage_requests_held", "Requests with KV state on this stage", s.requests_held)
        yield _gauge("stage_kv_blocks_used", "KV blocks held by live requests on this stage", s.kv_blocks_used)
        yield _gauge("stage_kv_blocks_cached", "KV blocks kept for prefix hits on this stage (evictable)",
                     s.kv_blocks_cached)
        yield _gauge("stage_kv_blocks_total", "This stage's KV pool in blocks", s.kv_blocks_total)
        yield _gauge("stage_kv_pool_bytes", "This stage's KV pool in bytes", s.kv_blocks_total * s.kv_block_bytes)
        yield _gauge("stage_kv_resident_bytes", "Bytes of the KV pool resident in memory: all of it with "
                     "--kv-prefault, else the blocks ever used (grows under load up to stage_kv_pool_bytes)",
                     s.kv_blocks_touched * s.kv_block_bytes)
        yield _gauge("stage_kv_used_tokens", "KV positions held on this stage", s.kv_used_tokens)
        yield _gauge("stage_kv_capacity_tokens", "This stage's KV pool in positions", s.kv_capacity_tokens)
        yield _gauge("stage_forward_streams", "Forward streams open now", s.forward_streams)
        yield _gauge("stage_replies_queued", "Replies waiting for their clients to read them", s.replies_queued)
        yield _gauge("stage_prefix_cache_hit_rate", "Slots that found their whole cached prefix / slots that asked, "
                     "since start", _ratio(s.prefix_hits, s.prefix_queries))
        yield _counter("stage_prefix_cache_queries", "Slots that asked for a cached prefix", s.prefix_queries)
        yield _counter("stage_prefix_cache_hits", "Slots that found every block of their cached prefix",
                       s.prefix_hits)
        yield _counter("stage_prefix_cache_hit_tokens", "Positions taken from the cache instead of computed",
                       s.prefix_hit_tokens)
        yield _counter("stage_prefix_cache_evictions", "Cached blocks evicted to make room", s.prefix_evictions)
        yield _counter("stage_busy_seconds", "Wall time spent in steps (rate() of it is the busy fraction)",
                       s.busy_seconds)
        yield _counter("stage_sampling_seconds", "Of the busy time, drawing tokens from the logits (last stage)",
                       s.sampling_seconds)
        yield _counter("stage_steps", "Frames with at least one slot processed", s.steps)
        yield _labelled("stage_rejections", "Slots this stage rejected, by RejectReason", "reason",
                        dict(s.rejections))
        yield _labelled("stage_refusals", "Frames or streams refused by a limit, by limit", "limit",
                        dict(s.refusals))
        yield _labelled("stage_faults_injected", "Faults this stage injected (experiments only), by kind", "kind",
                        dict(s.faults_injected))


# ------------------------------------------------------------------------------------- the coordinator's own

class CoordinatorMetrics:
    """What the coordinator observes per request: its queue time (submission to its first frame, once per
    request) and its failures."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Time from submission to the coordinator until the request's first frame is "
                                    "sent (waiting for KV room and a batch slot)",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.failures = Counter(PREFIX + "engine_request_failures", "Requests the coordinator failed, by gRPC "
                                "status code", ["code"], registry=registry)
        self.failed_recoveries = Counter(PREFIX + "failed_recoveries", "Requests whose recovery failed: "
                                         "rebuild_budget (ABORTED: rebuilds and resumes used up), pipeline_down "
                                         "(UNAVAILABLE: the pipeline was not back within the recovery window)",
                                         ["reason"], registry=registry)
        self.pending: dict[str, float] = {}     # request id -> when it was submitted, until its first frame

    def submitted(self, request_id: str) -> None:
        self.pending[request_id] = time.perf_counter()

    def on_batch(self, batch: Iterable) -> None:
        """Driver.on_batch: the requests of a frame about to be sent. A request's first frame ends its queue
        time; a frame after a rebuild or a preemption does not count again (its id is no longer pending)."""
        if not self.pending:
            return
        now = time.perf_counter()
        for req in batch:
            t = self.pending.pop(req.id, None)
            if t is not None:
                self.queue_time.observe(now - t)

    def ended(self, request_id: str, code_name: str | None = None) -> None:
        """The request ended (with a failure's status code name, if it failed)."""
        self.pending.pop(request_id, None)
        if code_name is None:
            return
        self.failures.labels(code_name).inc()
        if code_name == "ABORTED":
            self.failed_recoveries.labels("rebuild_budget").inc()
        elif code_name == "UNAVAILABLE":
            self.failed_recoveries.labels("pipeline_down").inc()


# ------------------------------------------------------------------------------------- admission

class AdmissionMetrics:
    """The front door: per-request latencies as the client sees them, tokens, requests per tenant, refusals."""

    def __init__(self, registry: CollectorRegistry, in_flight: Callable[[], int] = lambda: 0,
                 max_concurrent: int = 0, ready: Callable[[], bool] = lambda: False,
                 max_tenants: int = settings.METRICS_MAX_TENANTS) -> None:
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from the request's arrival at "
                              "admission to its first token", buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two successive tokens of a "
                             "request, at admission", buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from the request's arrival at "
                             "admission to its last token", buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests sent to the "
                                     "coordinator", registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens streamed to clients",
                                         registry=registry)
        self.requests = Counter(PREFIX + "requests", "Requests admitted and sent to the coordinator, by tenant "
                                f"(past {max_tenants} tenants: _other)", ["tenant"], registry=registry)
        self.success = Counter(PREFIX + "request_success", "Requests that ended with their last token, by finish "
                               "reason", ["finished_reason"], registry=registry)
        self.failures = Counter(PREFIX + "request_failures", "Admitted requests that ended with an error status, "
                                "by gRPC code (CANCELLED: the client went away)", ["code"], registry=registry)
        self.resumed = Counter(PREFIX + "requests_resumed", "Requests a pipeline dropped that admission continued "
                               "on another (or the same, once back) with the tokens already passed on, by how it "
                               "dropped them: session_broken (the coordinator's stream broke), unavailable (it "
                               "answered UNAVAILABLE), handed_back (it was draining)", ["reason"], registry=registry)
        self.shed = Counter(PREFIX + "requests_shed", "Requests refused by admission before reaching a "
                            "coordinator, by reason: overload (concurrency cap), fair_share (a tenant over its equal "
                            "part of a contended cap), tenant_concurrency (its max_concurrent), priority_<priority> "
                            "(shed near the cap), tenant_limit (its rates), tag_queue (no tokenizer worker free in "
                            "time), route_<code> (no pipeline can take it), not_ready, invalid, tag_timeout, "
                            "duplicate_label, worker_died, internal", ["reason"], registry=registry)
        self.auth_failures = Counter(PREFIX + "auth_failures", "Calls refused by admission's API-key check, by "
                                     "reason: missing, malformed, unknown_key (UNAUTHENTICATED), tenant, priority "
                                     "(PERMISSION_DENIED)", ["reason"], registry=registry)
        self.max_tenants = max_tenants
        self.tenants: set[str] = set()
        registry.register(_AdmissionGauges(in_flight, max_concurrent, ready))

    def tenant_label(self, tenant: str) -> str:
        label = tenant or "(default)"
        if label in self.tenants:
            return label
        if len(self.tenants) >= self.max_tenants:
            return "_other"
        self.tenants.add(label)
        return label

    def start(self, tenant: str, prompt_tokens: int, arrived: float) -> "RequestTimer":
        self.requests.labels(self.tenant_label(tenant)).inc()
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTimer(self, arrived)


class RequestTimer:
    """One request's latencies. `arrived` and every time given are time.perf_counter() values."""

    __slots__ = ("m", "arrived", "last", "tokens")

    def __init__(self, metrics: AdmissionMetrics, arrived: float) -> None:
        self.m, self.arrived, self.last, self.tokens = metrics, arrived, 0.0, 0

    def token(self, now: float) -> None:
        if self.tokens:
            self.m.itl.observe(now - self.last)
        else:
            self.m.ttft.observe(now - self.arrived)
        self.last = now
        self.tokens += 1

    def finished(self, reason: str, now: float) -> None:
        self.m.e2e.observe(now - self.arrived)
        self.m.generation_tokens.inc(self.tokens)
        self.m.success.labels(reason).inc()

    def failed(self, code_name: str) -> None:
        self.m.generation_tokens.inc(self.tokens)   # tokens the client did receive
        self.m.failures.labels(code_name).inc()


class _AdmissionGauges(Collector):
    def __init__(self, in_flight: Callable[[], int], max_concurrent: int, ready: Callable[[], bool]) -> None:
        self.in_flight, self.max_concurrent, self.ready = in_flight, max_concurrent, ready

    def collect(self) -> Iterator[Metric]:
        # plain int/bool reads of the loop's state: atomic under the GIL, no snapshot on the loop needed
        yield _gauge("admission_requests_in_flight", "Requests holding a slot under admission's concurrency cap",
                     self.in_flight())
        yield _gauge("admission_max_concurrent", "Admission's concurrency cap (--max-concurrent)",
                     self.max_concurrent)
        yield _gauge("admission_ready", "1 while admission's coordinator serves its model", self.ready())


class PipelinesCollector(Collector):
    """Admission's view of its pipelines (services/admission/pipelines.py `Pipelines`, read duck-typed: `links`
    of address -> link with `serving`, `in_flight` and a `breaker` with `state` and `opens`): routable or not,
    breaker state, requests in flight, breaker openings."""

    STATES = ("closed", "open", "half_open")

    def __init__(self, pipelines) -> None:
        self.pipelines = pipelines

    def collect(self) -> Iterator[Metric]:
        # plain reads of the loop's state: each value is atomic under the GIL
        up = GaugeMetricFamily(PREFIX + "pipeline_up", "1 while the pipeline's load reports say it serves "
                               "admission's model", labels=["pipeline"])
        breaker = GaugeMetricFamily(PREFIX + "pipeline_breaker_state", "The pipeline's circuit breaker: 1 for its "
                                    "current state (closed, open, half_open)", labels=["pipeline", "state"])
        in_flight = GaugeMetricFamily(PREFIX + "pipeline_requests_in_flight", "Requests admission has routed to "
                                      "the pipeline and not seen end", labels=["pipeline"])
        opens = CounterMetricFamily(PREFIX + "pipeline_breaker_opens", "Times the pipeline's circuit breaker "
                                    "opened", labels=["pipeline"])
        for link in list(self.pipelines.links.values()):
            up.add_metric([link.address], int(link.serving))
            for state in self.STATES:
                breaker.add_metric([link.address, state], int(link.breaker.state == state))
            in_flight.add_metric([link.address], link.in_flight)
            opens.add_metric([link.address], link.breaker.opens)
        yield from (up, breaker, in_flight, opens)


class ServerIdentityCollector(Collector):
    """Servers a channel of this process refused for not being the service identity it expected
    (tether/security/server_check.py REFUSED), by that identity."""

    def collect(self) -> Iterator[Metric]:
        from tether.security import server_check

        family = CounterMetricFamily(PREFIX + "server_identity_refusals", "Servers refused for not being the "
                                     "service identity a channel expected there (an impostor, a wrong route, a "
                                     "certificate without its server name), by the identity expected",
                                     labels=["expected"])
        for expected, n in list(server_check.REFUSED.items()):
            family.add_metric([expected], n)
        yield family


# Every tether metric family a service can expose (as Prometheus names them: counters end in _total,
# histograms have _bucket/_sum/_count series). The dashboard and docs are checked against it.
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds")


def metric_names() -> set[str]:
    """Every series name (histogram series, counters with _total) a tether service exposes."""
    from tether.v1 import coordinator_pb2, stage_pb2

    names: set[str] = set()
    registry = CollectorRegistry()
    AdmissionMetrics(registry)
    m = CoordinatorMetrics(registry)
    m.ended("x", "ABORTED")
    registry.register(CoordinatorCollector(lambda: coordinator_pb2.StatsReply()))
    registry.register(StageCollector(lambda: stage_pb2.StageStats()))
    registry.register(PipelinesCollector(type("NoPipelines", (), {"links": {}})()))
    registry.register(ServerIdentityCollector())
    for family in registry.collect():
        if family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        elif family.type == "counter":
            names.add(family.name + "_total")
        else:
            names.add(family.name)
    return names
