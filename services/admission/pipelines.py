"""The pipelines behind one admission: a link per coordinator (its channel, its Session stream, its live load
over `Coordinator.Watch`, its circuit breaker, what this admission has sent there), and the choice of one per
request (services/admission/routing.py) with shedding when the choice says the request cannot be served in
time (services/admission/limits.py).

A pipeline is routable while its last load report says it serves this admission's model and its breaker
lets requests through. A Watch stream that breaks marks its pipeline down (and trips its breaker) until a
new stream delivers a report.
"""

from __future__ import annotations

import array
import asyncio
import contextvars
import dataclasses
import logging
import socket
from collections.abc import Awaitable, Callable

import grpc
import xxhash

from services.admission.breaker import CircuitBreaker
from services.admission.limits import Refusal, shed_by_deadline
from services.admission.routing import NoPipeline, PipelineLoad, RouteRequest, Router, predicted_wait_s
from tether import settings, supervise
from tether.grpcutil import channel
from tether.model import dtypes
from tether.security import identity, server_check
from tether.security.tls import TlsConfig
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

# Tokens of a prompt's start that identify its prefix for affinity when the tagger found no system prompt: one
# KV block, the smallest prefix the stages cache.
PREFIX_TOKENS = settings.ATTENTION_BLOCK
DNS_PREFIX = "dns:"
# The coordinator statuses that say something about the pipeline (a breaker counts them); a cancel, bad input
# or a deadline the caller set do not.
PIPELINE_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


def parse_coordinators(spec: str) -> list[tuple[str, frozenset[str]]]:
    """`HOST:PORT[=ROLE+ROLE],...` -> [(address, roles)]: roles are size classes (short, medium, long). An
    address `dns:NAME:PORT` stands for every address NAME resolves to (a Kubernetes headless Service): the
    pipelines behind it are followed as they come and go (`Pipelines.discover`)."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        address, _, roles = item.partition("=")
        role_set = frozenset(r.strip() for r in roles.split("+") if r.strip())
        bad = role_set - {"short", "medium", "long"}
        if bad or ":" not in address.removeprefix(DNS_PREFIX):
            raise ValueError(f"bad coordinator {item!r}: expected HOST:PORT or HOST:PORT=ROLE[+ROLE] with roles "
                             f"among short, medium, long")
        out.append((address.strip(), role_set))
    if not out:
        raise ValueError("no coordinator given")
    if len({a for a, _ in out}) != len(out):
        raise ValueError(f"a coordinator is listed twice in {spec!r}")
    return out


def routing_key(token_ids: list[int], system_prefix_key: int, tenant: str) -> int:
    """What prefix affinity follows: the tagger's system-prompt key, else the prompt's first KV block; salted
    with the tenant, whose prefixes the stages never share with another tenant anyway. 0: none."""
    if system_prefix_key:
        return xxhash.xxh3_64_intdigest(f"{tenant}\0{system_prefix_key}".encode())
    if len(token_ids) < PREFIX_TOKENS:
        return 0
    h = xxhash.xxh3_64(tenant.encode() + b"\0")
    h.update(array.array("I", token_ids[:PREFIX_TOKENS]).tobytes())
    return h.intdigest() or 1


@dataclasses.dataclass
class Routed:
    """A request's place on a pipeline, from `Pipelines.choose` until `Pipelines.finished`."""

    link: "PipelineLink"
    cost: float
    reason: str


class PipelineLink:
    """One coordinator, as admission sees it."""

    def __init__(self, address: str, roles: frozenset[str], session_factory: Callable, fingerprint: str,
                 breaker: CircuitBreaker | None = None, tls: TlsConfig | None = None, name: str = "") -> None:
        self.address = address
        # What callers see (IntentTags.pipeline, route reasons, refusals): a stable name, never the address,
        # which maps the cluster's insides for whoever asks. The log says which address a name is.
        self.name = name or address
        self.tls = tls
        # With TLS: presenting admission's certificate (the only caller a coordinator serves), and the server
        # must be spiffe://tether.local/coordinator (verified by TLS under its server name on every connection,
        # whatever the address: configured or discovered by IP), or it is never sent a prompt.
        self.channel = channel(address, settings.COORDINATOR_MAX_MESSAGE_BYTES, tls=tls, expect=identity.COORDINATOR)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.session = session_factory(self.stub)
        self.fingerprint = fingerprint
        self.load = PipelineLoad(address, roles=roles)
        self.reason = "no load report yet"       # why it is not routable, while it is not
        self.served_fingerprint = ""             # from its load reports: the model and its stages' dtype
        self.breaker = breaker or CircuitBreaker()
        self.outstanding = 0.0                   # predicted cost of requests sent here, not finished
        self.in_flight = 0
        self.slots_per_step = settings.MAX_BATCH_SLOTS    # the coordinator's batch limits, from its reports
        self.tokens_per_step = settings.MAX_BATCH_TOKENS
        self.discovered = False                  # found through DNS: retired when it no longer resolves

    @property
    def serving(self) -> bool:
        return self.load.serving

    def report(self, r: coordinator_pb2.LoadReport) -> None:
        if not r.serving:
            serving, why = False, f"coordinator not serving: {r.status or 'no reason given'}"
        elif dtypes.model_part(r.model_fingerprint) != self.fingerprint:
            # its tokenizer and receipts would not match ours: routing there would give wrong answers
            serving, why = False, f"coordinator serves model {r.model_fingerprint}, admission loaded {self.fingerprint}"
        else:
            serving, why = True, "serving"
        self.load = PipelineLoad(
            self.address, serving=serving, max_context=r.max_context, kv_blocks_total=r.kv_blocks_total,
            kv_blocks_free=r.kv_blocks_free, block_tokens=r.kv_block_tokens or settings.ATTENTION_BLOCK,
            running=r.running, waiting=r.waiting, step_seconds=r.step_seconds, work=r.work,
            cache_generation=r.cache_generation, roles=self.load.roles)
        self.slots_per_step = r.max_batch_slots or settings.MAX_BATCH_SLOTS
        self.tokens_per_step = r.max_batch_tokens or settings.MAX_BATCH_TOKENS
        self.reason = why
        # what this pipeline's receipts name: the model and the numerics its stages chose (tether/model/numerics.py)
        self.served_fingerprint = r.model_fingerprint if serving else ""

    def down(self, why: str) -> None:
        self.load = dataclasses.replace(self.load, serving=False)
        self.reason = why
        self.breaker.trip()

    async def close(self) -> None:
        await self.channel.close()


class Pipelines:
    """Every pipeline behind this admission, and the choice of one per request."""

    def __init__(self, coordinators: list[tuple[str, frozenset[str]]], fingerprint: str,
                 session_factory: Callable, policy: str = "features",
                 watch_interval_s: float = settings.LOAD_REPORT_INTERVAL_S, tls: TlsConfig | None = None) -> None:
        self.fingerprint, self.session_factory, self.tls = fingerprint, session_factory, tls
        self.names = [(a.removeprefix(DNS_PREFIX), roles) for a, roles in coordinators if a.startswith(DNS_PREFIX)]
        self.named = 0                           # pipelines named so far: the next is pipeline-<named>
        self.links = {a: PipelineLink(a, roles, session_factory, fingerprint, tls=tls, name=self._name(a))
                      for a, roles in coordinators if not a.startswith(DNS_PREFIX)}
        self.router = Router(policy)
        self.watch_interval_s = watch_interval_s
        self.changed = asyncio.Event()           # a pipeline's routability changed (admission's health follows)
        self.watches: dict[str, asyncio.Task] = {}
        self.retired: dict[str, PipelineLink] = {}   # no longer resolved: closed once their requests ended

    # --- the set of pipelines -------------------------------------------------------------------------------
    def _name(self, address: str) -> str:
        """The public name of the next pipeline: pipeline-<i>, in the order of --coordinator, then of discovery
        (a configured pipeline keeps its name for the process's life; so does a discovered one that comes
        back while it is still draining)."""
        name = f"pipeline-{self.named}"
        self.named += 1
        log.info("%s is coordinator %s", name, address)
        return name

    def start(self) -> None:
        """Follow every configured pipeline's load (and, for `dns:` names, the set of pipelines)."""
        for link in self.links.values():
            self._follow(link)
        if self.names:
            self.watches["dns"] = asyncio.create_task(supervise.supervise("pipeline discovery", self.discover),
                                                      context=contextvars.Context())

    def _follow(self, link: PipelineLink) -> None:
        # A fresh context: a watch serves every request, it must not carry the one that started it.
        self.watches[link.address] = asyncio.create_task(
            supervise.supervise(f"watch {link.address}", lambda: self.watch(link)), context=contextvars.Context())

    def apply(self, resolved: dict[str, frozenset[str]]) -> None:
        """Make the DNS-discovered pipelines exactly `resolved` (address -> roles): new ones are followed at
        once; gone ones take no new requests and are closed when their last request ends."""
        for address, roles in resolved.items():
            if address not in self.links:
                link = self.retired.pop(address, None) or PipelineLink(
                    address, roles, self.session_factory, self.fingerprint, tls=self.tls, name=self._name(address))
                link.discovered = True
                self.links[address] = link
                self._follow(link)
                log.info("pipeline %s discovered", address)
        discovered = {a for a, link in self.links.items() if a not in resolved and link.discovered}
        for address in discovered:
            link = self.links.pop(address)
            task = self.watches.pop(address, None)
            if task is not None:
                task.cancel()
            self.retired[address] = link
            log.info("pipeline %s no longer resolves: draining %d request(s)", address, link.in_flight)
        self._close_drained()
        self.changed.set()

    def _close_drained(self) -> None:
        for address, link in list(self.retired.items()):
            if link.in_flight == 0:
                del self.retired[address]
                asyncio.get_running_loop().create_task(link.close())

    async def discover(self, resolve: Callable[[str, int], Awaitable[list[str]]] | None = None,
                       interval_s: float = settings.DISCOVERY_INTERVAL_S) -> None:
        """Resolve every `dns:` name every `interval_s` and apply the result; a failed lookup changes nothing."""
        resolve = resolve or resolve_addresses
        while True:
            resolved: dict[str, frozenset[str]] = {}
            try:
                for name, roles in self.names:
                    host, _, port = name.rpartition(":")
                    for ip in await resolve(host, int(port)):
                        resolved[f"{ip}:{port}"] = roles
            except OSError as e:
                log.warning("resolving the pipelines failed, keeping the ones known: %s", e)
            else:
                self.apply(resolved)
            await asyncio.sleep(interval_s)

    # --- readiness ------------------------------------------------------------------------------------------
    def ready(self) -> tuple[bool, str]:
        serving = [l for l in self.links.values() if l.serving]
        if serving:
            return True, f"{len(serving)} of {len(self.links)} pipeline(s) serving"
        why = "; ".join(f"{l.name} ({l.address}): {l.reason}" for l in self.links.values())   # for the log
        return False, f"no pipeline serving ({why})"

    async def watch(self, link: PipelineLink) -> None:
        """Follow one coordinator's load reports forever; reconnect after a broken stream (supervised)."""
        request = coordinator_pb2.WatchRequest(interval_s=self.watch_interval_s)
        while True:
            was = link.serving
            try:
                async for report in link.stub.Watch(request):
                    link.report(report)
                    if link.serving != was:
                        was = link.serving
                        if link.serving:
                            link.breaker.success()
                        self.changed.set()
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "the coordinator ended Watch")
            except grpc.aio.AioRpcError as e:
                why = await server_check.refusal(link.address, link.tls, identity.COORDINATOR)
                link.down(f"refused the server as a coordinator: {why}" if why is not None else
                          f"coordinator unreachable: {e.code().name} {e.details()}")
            if was:
                self.changed.set()
            await asyncio.sleep(settings.READINESS_POLL_S)


    # --- a request's route ----------------------------------------------------------------------------------
    def choose(self, req: RouteRequest, deadline_s: float | None, avoid: str | None = None) -> Routed:
        """Pick a pipeline for `req`, or raise Refused: no pipeline can take it, or none would start it before
        its deadline (`deadline_s`: seconds left, None when the caller set none). `avoid`: a pipeline that just
        dropped this request, left out while there is another (its load report may not say so yet)."""
        links = [l for l in self.links.values() if l.address != avoid] or list(self.links.values())
        try:
            decision = self.router.route(req, [l.load for l in links],
                                         {l.address: l.outstanding for l in links},
                                         {l.address: l.in_flight for l in links},
                                         lambda name: self.links[name].breaker.would_allow())
        except NoPipeline as e:
            if e.retryable:
                wait = min([l.breaker.retry_after_s() for l in links if l.breaker.retry_after_s() > 0] or
                           [settings.OVERLOAD_RETRY_AFTER_S])
                raise Refused(grpc.StatusCode.UNAVAILABLE, str(e), max(wait, 0.1)) from None
            # A pool too small is the server's limit (RESOURCE_EXHAUSTED, as the coordinator answers it); a
            # context window too small is the request's fault. Neither gets better by retrying.
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if e.kv else grpc.StatusCode.INVALID_ARGUMENT
            raise Refused(code, str(e), None) from None
        link = self.links[decision.pipeline]
        wait = predicted_wait_s(link.load, link.in_flight, req, link.slots_per_step, link.tokens_per_step)
        shed: Refusal | None = shed_by_deadline(wait, deadline_s)
        if shed is not None:
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, shed.message, shed.retry_after_s)
        if not link.breaker.allow():    # a half-open breaker's probe slot went to another request meanwhile
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"pipeline {link.name} is being probed after failures; "
                                                       f"retry shortly", max(0.1, link.breaker.retry_after_s()))
        link.outstanding += req.cost
        link.in_flight += 1
        return Routed(link, req.cost, f"{link.name} ({decision.policy}: {decision.reason})")

    def finished(self, routed: Routed, code: grpc.StatusCode | None) -> None:
        """The request ended: `code` None when it finished, else its status. Feeds the pipeline's breaker."""
        link = routed.link
        link.outstanding = max(0.0, link.outstanding - routed.cost)
        link.in_flight -= 1
        if link.address in self.retired:
            self._close_drained()
        if code is None:
            link.breaker.success()
        elif code in PIPELINE_FAILURES:
            link.breaker.failure()
        else:
            link.breaker.neutral()

    async def close(self) -> None:
        for task in self.watches.values():
            task.cancel()
        await asyncio.gather(*(l.close() for l in [*self.links.values(), *self.retired.values()]))


async def resolve_addresses(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (IPv6 ones bracketed), off the event loop."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({f"[{i[4][0]}]" if i[0] == socket.AF_INET6 else i[4][0] for i in infos})


class Refused(Exception):
    """Admission will not route this request now: the status to answer with, and when to retry (None: don't)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


async def watch_readiness(pipelines: Pipelines, on_change: Callable[[bool, str], Awaitable[None]]) -> None:
    """Call `on_change` with admission's readiness whenever a pipeline's routability changes (supervised)."""
    last: tuple[bool, str] | None = None
    while True:
        now = pipelines.ready()
        if now != last:
            await on_change(*now)
            last = now
        pipelines.changed.clear()
        try:
            async with asyncio.timeout(settings.READINESS_POLL_S):
                await pipelines.changed.wait()
        except TimeoutError:
            pass
