"""The Admission service: validate, tag, limit, route to a pipeline, stream back with a receipt.

Order of work per request, cheapest refusal first: the caller's API key once any is configured (auth.py:
UNAUTHENTICATED; PERMISSION_DENIED for a tenant or priority the key may not use), readiness (UNAVAILABLE while
no pipeline serves our model), the concurrency slot (RESOURCE_EXHAUSTED + RetryInfo), then tokenizing and
tagging (large requests in worker processes, within a time budget: front_work.py; INVALID_ARGUMENT), the
caller's label (ALREADY_EXISTS while the same tenant has it in flight), the tenant's rate limits and shedding
by priority (limits.py; RESOURCE_EXHAUSTED + RetryInfo), the choice of a pipeline (pipelines.py, routing.py:
UNAVAILABLE + RetryInfo while every pipeline that could take it is down or its breaker open; RESOURCE_EXHAUSTED
when none would start it before its deadline), and only then that pipeline's coordinator. Every request gets an
internal id minted here; the caller's `request_id` is a label, echoed in the receipt and never a key downstream.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures.process import BrokenProcessPool
from contextlib import aclosing, asynccontextmanager

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from services.admission.auth import ApiKeys, AuthError, Principal, authorize
from services.admission.front_work import FrontWork, admit
from services.admission.limits import Refusal, TenantLimits, shed_by_priority
from services.admission.pipelines import Pipelines, Refused, Routed, routing_key, watch_readiness
from services.admission.routing import RouteRequest
from services.admission.tagger import Tags, normalize_priority
from services.admission.validate import ModelLimits, ValidRequest
from tether import settings
from tether.grpcutil import Server
from tether.protocol.hashing import messages_digest, prompt_digest
from tether.telemetry import logs, tracing
from tether.telemetry.metrics import AdmissionMetrics
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

STATUS_DETAILS_KEY = "grpc-status-details-bin"
Event = tuple[coordinator_pb2.TokenEvent, common_pb2.Receipt | None]   # a token, with the receipt on the last


class ConcurrencyLimit:
    """A non-blocking cap: a request over it is refused at once, never queued, never a hang (docs/PROTOCOL.md
    "Limits, lifetimes and supervision")."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def try_acquire(self) -> bool:
        # No lock: the asyncio loop runs this check-and-increment without interleaving.
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1


def retry_status_details(code: grpc.StatusCode, message: str, retry_after_s: float) -> bytes:
    """A serialized google.rpc.Status with a RetryInfo detail (the value of grpc-status-details-bin)."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_after_s * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status_pb2.Status(code=code.value[0], message=message, details=[detail]).SerializeToString()


def tags_proto(tags: Tags, routed: Routed | None = None) -> common_pb2.IntentTags:
    proto = common_pb2.IntentTags(**dataclasses.asdict(tags))
    if routed is not None:
        proto.pipeline, proto.route_reason = routed.link.address, routed.reason
    return proto


@dataclasses.dataclass(frozen=True)
class Admitted:
    """A request past every check of admission: its internal id, the validated request and its tags."""

    internal_id: str
    valid: ValidRequest
    tags: Tags


class AdmissionServicer(admission_pb2_grpc.AdmissionServicer):
    """Generate, GenerateStream and Tag, each request routed to one of the pipelines (a Session stream each)."""

    def __init__(self, pipelines: Pipelines, model: ModelLimits,
                 model_fingerprint: str, max_concurrent: int = settings.MAX_CONCURRENT_REQUESTS,
                 max_lifetime_s: float = settings.MAX_REQUEST_LIFETIME_S,
                 tag_budget_s: float = settings.TAG_BUDGET_S, work: FrontWork | None = None,
                 metrics: AdmissionMetrics | None = None, tenant_limits: TenantLimits | None = None,
                 api_keys: ApiKeys | None = None) -> None:
        self.pipelines = pipelines
        self.tenant_limits = tenant_limits or TenantLimits()   # no file: no tenant is limited
        self.api_keys = api_keys or ApiKeys()                  # no key configured: the body's tenant stands
        self.model = model
        self.model_fingerprint = model_fingerprint
        self.limit = ConcurrencyLimit(max_concurrent)
        self.max_lifetime_s = max_lifetime_s
        self.tag_budget_s = tag_budget_s
        # Tokenizing and tagging large requests are CPU work: in worker processes, never on the event loop,
        # which must keep streaming tokens (front_work.py). Without a pool (tests) everything runs inline.
        self.work = work
        self.ready = False                               # set by follow_readiness
        self.not_ready_reason = "admission has not reached a coordinator yet"
        self.labels: dict[tuple[str, str], str] = {}     # (tenant, caller label) -> internal id, while in flight
        self.metrics = metrics                           # None: --metrics-port off, nothing observed
        self.model_name = model_fingerprint              # gen_ai.request.model of traces (main.py: --model)

    def set_ready(self, ready: bool, reason: str) -> None:
        self.ready, self.not_ready_reason = ready, reason

    # ---- RPCs -------------------------------------------------------------------------------------------

    async def Generate(self, request: admission_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> admission_pb2.GenerateResponse:
        async with self._handle("Generate", request, context) as (a, routed, events):
            response = admission_pb2.GenerateResponse(tags=tags_proto(a.tags, routed), seed=a.valid.sampling.seed)
            text: list[str] = []
            async for event, receipt in events:
                response.token_ids.append(event.token_id)
                text.append(event.text)
                if receipt is not None:
                    response.finish_reason = event.finish_reason
                    response.receipt.CopyFrom(receipt)
        response.text = "".join(text)
        return response

    async def GenerateStream(self, request: admission_pb2.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[admission_pb2.GenerateChunk]:
        async with self._handle("GenerateStream", request, context) as (a, routed, events):
            async for event, receipt in events:
                chunk = admission_pb2.GenerateChunk(index=event.index, token_id=event.token_id,
                                                    text=event.text, finish_reason=event.finish_reason)
                if event.index == len(a.valid.resume_token_ids):   # this call's first chunk (0 unless resumed)
                    chunk.tags.CopyFrom(tags_proto(a.tags, routed))
                    chunk.seed = a.valid.sampling.seed
                    chunk.internal_id = a.internal_id
                if receipt is not None:
                    chunk.receipt.CopyFrom(receipt)
                yield chunk

    async def Tag(self, request: admission_pb2.TagRequest,
                  context: grpc.aio.ServicerContext) -> admission_pb2.TagResponse:
        as_generate = admission_pb2.GenerateRequest(prompt=request.prompt, sampling=request.sampling,
                                                    tenant=request.tenant, priority=request.priority,
                                                    messages=request.messages)
        principal = await self._authenticate(context)
        await self._acquire(context)   # the same CPU work as a request: the same cap
        try:
            a = await self._admit(as_generate, context, take_label=False, principal=principal)
        finally:
            self.limit.release()
        return admission_pb2.TagResponse(tags=tags_proto(a.tags))

    # ---- steps ------------------------------------------------------------------------------------------

    @asynccontextmanager
    async def _handle(self, rpc: str, request: admission_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                      ) -> AsyncIterator[tuple[Admitted, Routed, AsyncIterator[Event]]]:
        """One request from arrival to its end, for Generate and GenerateStream alike: entered, admitted and
        routed, then its (event, receipt) pairs from the coordinator for the body to pass on; on the way out,
        however it ends, its slot and label are released and its trace ended with the error it ended with."""
        arrived = time.perf_counter()
        rt, principal = await self._enter(rpc, context)
        a: Admitted | None = None
        error: BaseException | None = None
        try:
            a = await self._admit(request, context, rt=rt, principal=principal)
            routed = await self._route(a, context, rt)
            # aclosing: when grpc.aio cancels the handler (disconnect, deadline) while it waits to send, the
            # inner generator must close now, cancelling the coordinator call, not whenever it is collected.
            async with aclosing(self._generate(request, a, routed, context, arrived, rt)) as events:
                yield a, routed, events
        except BaseException as e:
            error = e
            raise
        finally:
            self._done(a)
            if rt is not None:
                rt.end(context, error)

    async def _enter(self, rpc: str, context: grpc.aio.ServicerContext,
                     ) -> "tuple[RequestTrace | None, Principal | None]":
        """The caller's key, readiness, then a concurrency slot: the request's trace when tracing is on (ended
        here if refused) and the caller's principal (None while no key is configured)."""
        rt = RequestTrace(rpc, context) if tracing.TRACER is not None else None
        try:
            principal = await self._authenticate(context)
            await self._check_ready(context)
            await self._acquire(context)
        except BaseException as e:
            if rt is not None:
                rt.end(context, e)
            raise
        return rt, principal

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> Principal | None:
        """The caller's principal from its API key, or UNAUTHENTICATED; None (anyone) while no key is configured.
        First of all checks: a caller without a key learns nothing, not even readiness, and takes no slot."""
        if not self.api_keys.active:
            return None
        got = self.api_keys.authenticate(context.invocation_metadata())
        if isinstance(got, AuthError):
            await self._auth_failed(context, got)
        return got

    async def _authorize(self, request: admission_pb2.GenerateRequest, principal: Principal,
                         context: grpc.aio.ServicerContext) -> None:
        """Run the request as the key's tenant (an empty body tenant becomes it), or PERMISSION_DENIED for
        another tenant or a priority the tenant may not use."""
        try:
            priority = normalize_priority(request.priority)
        except ValueError:
            priority = request.priority   # not a priority at all: validation refuses it with INVALID_ARGUMENT
        got = authorize(principal, request.tenant, priority)
        if isinstance(got, AuthError):
            await self._auth_failed(context, got)
        request.tenant = got   # the handler's own message: the tenant every later step reads

    async def _auth_failed(self, context: grpc.aio.ServicerContext, error: AuthError) -> None:
        if self.metrics is not None:
            self.metrics.auth_failures.labels(error.reason).inc()
        log.debug("refused a call (%s): %s", error.reason, error.message)   # the message never holds the key
        await context.abort(error.code, error.message)

    async def _check_ready(self, context: grpc.aio.ServicerContext) -> None:
        """Never forward while no pipeline serves our model: that answer would be wrong."""
        if not self.ready:
            self._shed("not_ready")
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"admission is not ready: {self.not_ready_reason}")

    async def _admit(self, request: admission_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                     take_label: bool = True, rt: "RequestTrace | None" = None,
                     principal: Principal | None = None) -> Admitted:
        """The key's tenant and priorities (with a principal), then tokenize, validate and tag; mint the internal
        id; take the caller's label (released by `_done`)."""
        started = time.time_ns() if rt is not None else 0
        if principal is not None:
            await self._authorize(request, principal, context)
        try:
            if self.work is None or self.work.is_inline(request):
                valid, tags = admit(request, self.model)   # small: cheaper now than shipped (< 1 ms)
            else:
                valid, tags = await self.work.run(request, self.tag_budget_s)
        except ValueError as e:  # ValidationError, or the tagger refusing the sizes it was given
            self._shed("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError:
            self._shed("tag_timeout")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the prompt took longer than {self.tag_budget_s:g} s to tokenize and tag; "
                                f"send a shorter prompt")
        except BrokenProcessPool:
            self._shed("worker_died")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "admission's tokenizer worker died while handling "
                                                             "this request; it was restarted: retry")
        except Exception as e:   # noqa: BLE001 - a bug must reach the caller as a status that says so
            log.exception("admitting a request failed")
            self._shed("internal")
            await context.abort(grpc.StatusCode.INTERNAL, f"admission failed to process the request: {e!r}")
        a = Admitted(uuid.uuid4().hex, valid, tags)
        if rt is not None:
            rt.admitted(a, self.model_name, self.model_fingerprint, request, started)
        if take_label and valid.request_id:
            key = (valid.tenant, valid.request_id)
            if key in self.labels:
                self._shed("duplicate_label")
                await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                    f"request_id {valid.request_id!r} is already in flight for tenant "
                                    f"{valid.tenant or '(default)'}; use a new request_id per request")
            self.labels[key] = a.internal_id   # checked and taken with no await between
        return a

    def _done(self, a: Admitted | None) -> None:
        """The request ended, however: free its concurrency slot and its caller label."""
        self.limit.release()
        if a is not None and a.valid.request_id:
            key = (a.valid.tenant, a.valid.request_id)
            if self.labels.get(key) == a.internal_id:
                del self.labels[key]

    async def _acquire(self, context: grpc.aio.ServicerContext) -> None:
        """Take a slot under the concurrency cap, or refuse with RESOURCE_EXHAUSTED and a RetryInfo detail."""
        if self.limit.try_acquire():
            return
        self._shed("overload")
        message = (f"admission is at its limit of {self.limit.limit} concurrent requests; "
                   f"retry in {settings.OVERLOAD_RETRY_AFTER_S:g} s")
        details = retry_status_details(grpc.StatusCode.RESOURCE_EXHAUSTED, message, settings.OVERLOAD_RETRY_AFTER_S)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message, ((STATUS_DETAILS_KEY, details),))

    async def _route(self, a: Admitted, context: grpc.aio.ServicerContext,
                     rt: "RequestTrace | None" = None) -> Routed:
        """The tenant's limits, shedding by priority, then a pipeline: or a refusal with RetryInfo."""
        if rt is None:
            return await self._choose(a, context)
        started = time.time_ns()
        try:
            routed = await self._choose(a, context)
        except BaseException as e:
            rt.routed(None, started, context, e)
            raise
        rt.routed(routed, started)
        return routed

    async def _choose(self, a: Admitted, context: grpc.aio.ServicerContext) -> Routed:
        valid, tags = a.valid, a.tags
        refusal: Refusal | None = shed_by_priority(tags.priority, self.limit.active - 1, self.limit.limit)
        if refusal is not None:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message, refusal.retry_after_s,
                               f"priority_{tags.priority}")
        refusal = self.tenant_limits.check(valid.tenant, len(valid.prompt_token_ids) + tags.output_budget)
        if refusal is not None:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message, refusal.retry_after_s,
                               "tenant_limit")
        req = RouteRequest(len(valid.prompt_token_ids), tags.output_budget, tags.size_class, tags.priority,
                           routing_key(valid.prompt_token_ids, tags.prefix_key, valid.tenant))
        try:
            return self.pipelines.choose(req, context.time_remaining())
        except Refused as e:
            await self._refuse(context, e.code, e.message, e.retry_after_s, f"route_{e.code.name.lower()}")
        raise AssertionError("unreachable: _refuse aborts")

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                      retry_after_s: float | None, reason: str) -> None:
        self._shed(reason)
        trailers = ()
        if retry_after_s is not None:
            trailers = ((STATUS_DETAILS_KEY, retry_status_details(code, message, retry_after_s)),)
        await context.abort(code, message, trailers)

    def _shed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.shed.labels(reason).inc()

    async def _generate(self, request: admission_pb2.GenerateRequest, a: Admitted, routed: Routed,
                        context: grpc.aio.ServicerContext, arrived: float, rt: "RequestTrace | None" = None,
                        ) -> AsyncIterator[Event]:
        """Yield the coordinator's events in order, the last one with its receipt; abort on any error.
        `arrived`: time.perf_counter() when the call reached admission (the latency metrics start there)."""
        valid, tags, rid = a.valid, a.tags, a.internal_id
        logs.set_request(rid, valid.request_id)   # this handler's task: every line it logs carries the id
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(valid.sampling)
        sampling.max_tokens = tags.output_budget
        # The caller's deadline bounds the request downstream too, so the coordinator stops working on it in
        # time; a caller without one gets the maximum lifetime.
        remaining = context.time_remaining()
        lifetime_applied = remaining is None
        submit = coordinator_pb2.SubmitRequest(request_id=rid, prompt_token_ids=valid.prompt_token_ids,
                                               sampling=sampling, tenant=valid.tenant, priority=valid.priority,
                                               label=valid.request_id, resume_tokens=valid.resume_token_ids,
                                               timeout_s=self.max_lifetime_s if lifetime_applied else remaining)
        if rt is not None:
            submit.traceparent = rt.traceparent   # the coordinator's span of the request is a child of ours
        target = routed.link.address
        events = routed.link.session.start(submit)
        timer = self.metrics.start(valid.tenant, len(valid.prompt_token_ids), arrived) if self.metrics else None
        failure: tuple[grpc.StatusCode, str] | None = None
        ended = False            # the coordinator ended the request (last token or a status): nothing to cancel
        finished = False         # ... with its last token
        try:
            count = len(valid.resume_token_ids)   # a resumed request's events start after what it already has
            while True:
                event = await events.get()
                if isinstance(event, SessionBroken):
                    ended = True
                    failure = (event.code, f"coordinator {target} said: {event.details}")
                    break
                if event.status_code:
                    ended = True
                    code = STATUS_CODES.get(event.status_code, grpc.StatusCode.UNKNOWN)
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED and lifetime_applied:
                        failure = (code, f"request ran past admission's maximum lifetime of {self.max_lifetime_s:g} s "
                                         f"(the call set no deadline)")
                    else:
                        failure = (code, f"coordinator {target} said: {event.status_message}")
                    break
                if event.index != count:
                    failure = (grpc.StatusCode.INTERNAL, f"coordinator skipped a token index: expected {count}, "
                                                         f"got {event.index} (request {rid})")
                    break
                count += 1
                if timer is not None:
                    timer.token(time.perf_counter())
                if event.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    yield event, None
                    continue
                ended = finished = True
                if rt is not None:
                    rt.finished(count, FINISH_REASONS.get(event.finish_reason, "unknown"))
                if timer is not None:
                    timer.finished(FINISH_REASONS.get(event.finish_reason, "unknown"), time.perf_counter())
                yield event, common_pb2.Receipt(
                    request_id=valid.request_id, prompt_digest=request_digest(request),
                    prompt_tokens=len(valid.prompt_token_ids), context_hash=event.context_hash,
                    output_tokens=count, model_fingerprint=self.model_fingerprint, internal_id=rid)
                return
        finally:
            # Runs on client disconnect and deadline too (grpc.aio cancels this task): stop the coordinator's work.
            routed.link.session.end(rid, cancel=not ended)
            self.pipelines.finished(routed, None if finished else failure[0] if failure else grpc.StatusCode.CANCELLED)
            if timer is not None and not finished:
                timer.failed(failure[0].name if failure else "CANCELLED")
            if rt is not None and not finished:
                rt.usage(count)
            # One line per request at DEBUG (free at INFO): with --log-format json, an access log keyed by id.
            log.debug("request %s ended: %s after %d token(s)", rid,
                      "finished" if finished else failure[0].name if failure else "CANCELLED", count)
        log.warning("request %s (label %r) failed: %s %s", rid, valid.request_id, failure[0].name, failure[1])
        await context.abort(*failure)


class RequestTrace:
    """Admission's span of one request (built only while tracing is on): a SERVER span, child of the caller's
    `traceparent` metadata if any, with children for validate+tag and route; its traceparent goes to the
    coordinator in the SubmitRequest. Attributes: GenAI semantic conventions (gen_ai.*) and the intent tags
    and routing decision as tether.*. Every log line of the handler's task carries its trace id."""

    def __init__(self, method: str, context: grpc.aio.ServicerContext) -> None:
        caller = tracing.metadata_traceparent(context.invocation_metadata())
        self.span = tracing.start(f"admission {method}", tracing.parent(caller), tracing.SpanKind.SERVER,
                                  {"rpc.system": "grpc", "rpc.service": "tether.v1.Admission", "rpc.method": method})
        # Propagate only a recording span's context: an unsampled request costs the stages nothing.
        self.traceparent = tracing.traceparent(self.span) if self.span.is_recording() else ""
        logs.TRACE_ID.set(tracing.trace_id(self.span) if self.traceparent else None)   # this task's lines

    def _child(self, name: str, started_ns: int, attributes: dict) -> tracing.Span:
        return tracing.TRACER.start_span(name, context=tracing.child_of(self.span), attributes=attributes,
                                         start_time=started_ns)

    def admitted(self, a: Admitted, model: str, fingerprint: str, request: admission_pb2.GenerateRequest,
                 started_ns: int) -> None:
        valid, tags = a.valid, a.tags
        attributes = {f"tether.{k}": v for k, v in dataclasses.asdict(tags).items()}
        attributes["tether.prefix_key"] = f"{tags.prefix_key:016x}"   # a uint64: not an OTel int64 attribute
        attributes.update({
            "gen_ai.operation.name": "chat" if request.messages else "text_completion",
            "gen_ai.system": "tether",
            "gen_ai.request.model": model,
            "tether.model_fingerprint": fingerprint,
            "gen_ai.request.max_tokens": tags.output_budget,
            "gen_ai.request.temperature": valid.sampling.temperature,
            "gen_ai.usage.input_tokens": len(valid.prompt_token_ids),
            "tether.request_id": a.internal_id,
        })
        if valid.sampling.top_p:
            attributes["gen_ai.request.top_p"] = valid.sampling.top_p
        if 0 < valid.sampling.seed < 2**63:   # OTel ints are int64; the seed is a uint64
            attributes["gen_ai.request.seed"] = valid.sampling.seed
        if valid.request_id:
            attributes["tether.label"] = valid.request_id
        self.span.set_attributes(attributes)
        self._child("admission validate+tag", started_ns,
                    {"tether.input_tokens": tags.input_tokens, "tether.language": tags.language,
                     "tether.task": tags.task, "tether.size_class": tags.size_class}).end()

    def routed(self, routed: Routed | None, started_ns: int, context: grpc.aio.ServicerContext | None = None,
               error: BaseException | None = None) -> None:
        attributes = {}
        if routed is not None:
            attributes = {"tether.pipeline": routed.link.address, "tether.route_reason": routed.reason}
            self.span.set_attributes(attributes)
        span = self._child("admission route", started_ns, attributes)
        if error is not None:
            _fail_span(span, context, error)
        span.end()

    def finished(self, output_tokens: int, finish_reason: str) -> None:
        self.span.set_attributes({"gen_ai.usage.output_tokens": output_tokens,
                                  "gen_ai.response.finish_reasons": [finish_reason]})

    def usage(self, output_tokens: int) -> None:
        self.span.set_attribute("gen_ai.usage.output_tokens", output_tokens)

    def end(self, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
        if error is not None:
            _fail_span(self.span, context, error)
        self.span.end()


def _fail_span(span: tracing.Span, context: grpc.aio.ServicerContext | None, error: BaseException) -> None:
    """A span ended by an abort (its status code and details from the context), a cancellation or a bug."""
    code = context.code() if context is not None else None
    if isinstance(code, grpc.StatusCode):
        tracing.fail(span, code.name, context.details() or "")
    elif isinstance(error, asyncio.CancelledError):
        tracing.fail(span, "CANCELLED", "the call was cancelled (client gone or deadline)")
    else:
        tracing.fail(span, type(error).__name__, str(error))


STATUS_CODES = {c.value[0]: c for c in grpc.StatusCode}
# FINISH_REASON_LENGTH -> "length": the `finished_reason` label of tether:request_success_total
FINISH_REASONS = {v: n.removeprefix("FINISH_REASON_").lower() for n, v in common_pb2.FinishReason.items()}
_SESSION_BATCH_BYTES = 256 * 1024   # submits per SessionMessage: one prompt alone is far under the 1 MiB limit


@dataclasses.dataclass(frozen=True)
class SessionBroken:
    """What every request of a Session stream gets when the stream fails: the stream's status."""

    code: grpc.StatusCode
    details: str


class _SessionStream:
    """One Session call: a writer sending the submits and cancels queued since its last write as one message,
    and a reader handing each TokenEvent to its request's queue."""

    def __init__(self, stub: coordinator_pb2_grpc.CoordinatorStub) -> None:
        self.call = stub.Session()
        self.sinks: dict[str, asyncio.Queue] = {}
        self.submits: list[coordinator_pb2.SubmitRequest] = []
        self.cancels: list[str] = []
        self.wake = asyncio.Event()
        self.broken = False
        # A fresh context: the stream serves every request, so it must not inherit the request context (log
        # request id) of the request that happened to open it.
        self.tasks = [asyncio.create_task(self._write(), context=contextvars.Context()),
                      asyncio.create_task(self._read(), context=contextvars.Context())]

    async def _write(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                while self.submits or self.cancels:
                    # Under the coordinator's message limit (1 MiB) whatever the prompts: a message it refuses
                    # would fail the whole stream.
                    n, size = 0, 0
                    while n < len(self.submits) and (n == 0 or size < _SESSION_BATCH_BYTES):
                        size += self.submits[n].ByteSize()
                        n += 1
                    msg = coordinator_pb2.SessionMessage(submit=self.submits[:n], cancel=self.cancels)
                    self.submits, self.cancels = self.submits[n:], []
                    await self.call.write(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:   # noqa: BLE001 - the call failed: its status (the reader's) says more, if it comes
            await asyncio.wait([self.tasks[1]], timeout=1.0)
            self._break(grpc.StatusCode.UNAVAILABLE, f"session stream failed: {e!r}")

    async def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the coordinator ended the session stream"
        try:
            async for batch in self.call:
                for event in batch.events:
                    q = self.sinks.get(event.request_id)
                    if q is not None:
                        q.put_nowait(event)
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details()
        self._break(code, details)

    def _break(self, code: grpc.StatusCode, details: str) -> None:
        if self.broken:
            return
        self.broken = True
        for q in self.sinks.values():
            q.put_nowait(SessionBroken(code, details))
        self.sinks.clear()
        self.call.cancel()
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()


class CoordinatorSession:
    """Requests to the coordinator over one Session stream, opened on first use and again after one breaks:
    a token costs a share of one message instead of a message, and a request no call of its own."""

    def __init__(self, stub: coordinator_pb2_grpc.CoordinatorStub) -> None:
        self.stub = stub
        self.stream: _SessionStream | None = None
        self.by_id: dict[str, _SessionStream] = {}     # request id -> the stream it was started on

    def start(self, submit: coordinator_pb2.SubmitRequest) -> asyncio.Queue:
        """Start a request; its queue gets its TokenEvents in order, or a SessionBroken."""
        if self.stream is None or self.stream.broken:
            self.stream = _SessionStream(self.stub)
        stream, q = self.stream, asyncio.Queue()
        stream.sinks[submit.request_id] = q
        self.by_id[submit.request_id] = stream
        stream.submits.append(submit)
        stream.wake.set()
        return q

    def end(self, request_id: str, cancel: bool) -> None:
        """Forget a request; with `cancel`, also tell the coordinator to stop it (it had not ended)."""
        stream = self.by_id.pop(request_id, None)
        if stream is None:
            return
        stream.sinks.pop(request_id, None)
        if cancel and not stream.broken:
            stream.cancels.append(request_id)
            stream.wake.set()


def request_digest(request: admission_pb2.GenerateRequest) -> int:
    """The receipt's prompt_digest: of the prompt bytes, or of the conversation as received (docs/PROTOCOL.md)."""
    if request.messages:
        return messages_digest((m.role, m.content) for m in request.messages)
    return prompt_digest(request.prompt)


async def follow_readiness(server: Server, servicer: AdmissionServicer) -> None:
    """Report SERVING only while some pipeline serves our model (from their load reports; supervised)."""
    async def changed(ready: bool, why: str) -> None:
        servicer.set_ready(ready, why)
        await server.set_serving(ready)
        log.log(logging.INFO if ready else logging.WARNING, "admission %s (%s)",
                "SERVING" if ready else "NOT_SERVING", why)

    await watch_readiness(servicer.pipelines, changed)
