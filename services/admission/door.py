"""The front door's admit path, the same for every face (gRPC: server.py; HTTP: openai_api/): validate, tag,
limit, route to a pipeline, stream back with a receipt. A refusal or failure is a `Rejected` (status.py), which
each face puts in its own wire form; what happens to each request is reported through its `Outcome`.

Order of work per request, cheapest refusal first, and no work for a tenant before its limits are checked:
the caller's API key once any is configured (auth.py: UNAUTHENTICATED; PERMISSION_DENIED for a tenant or
priority the key may not use), readiness (UNAVAILABLE while no pipeline serves our model), the tenant's request
rate and a concurrency slot within its fair share of the cap (limits.py; RESOURCE_EXHAUSTED + RetryInfo), then
tokenizing and tagging (large requests in worker processes, one tenant's queue at a time: front_work.py; a wait
for a worker is RESOURCE_EXHAUSTED + RetryInfo, only the prompt's own time past the budget INVALID_ARGUMENT),
the caller's label (ALREADY_EXISTS while the same tenant has it in flight), shedding by priority and the
tenant's token rate (limits.py; RESOURCE_EXHAUSTED + RetryInfo), the choice of a pipeline (pipelines.py, routing.py:
UNAVAILABLE + RetryInfo while every pipeline that could take it is down or its breaker open; RESOURCE_EXHAUSTED
when none would start it before its deadline), and only then that pipeline's coordinator. Every request gets an
internal id minted here; the caller's `request_id` is a label, echoed in the receipt and never a key downstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures.process import BrokenProcessPool
from contextlib import aclosing, asynccontextmanager
from typing import NoReturn

import grpc

from services.admission.auth import ApiKeys, AuthError, Principal, authorize
from services.admission.front_work import Busy, FrontWork, admit
from services.admission.limits import ConcurrencyShares, Refusal, TenantLimits, shed_by_priority
from services.admission.outcome import Admitted, Call, Outcome
from services.admission import public
from services.admission.pipelines import Pipelines, Routed, Refused, routing_key
from services.admission.routing import RouteRequest
from services.admission.session import SessionBroken
from services.admission.status import FINISH_REASONS, STATUS_CODES, Rejected
from services.admission.tagger import Tags
from services.admission.validate import ModelLimits
from tether import settings
from tether.priority import parse as parse_priority
from tether.protocol.hashing import messages_digest, prompt_digest
from tether.telemetry import logs
from tether.telemetry.metrics import AdmissionMetrics
from tether.v1 import admission_pb2, common_pb2, coordinator_pb2

log = logging.getLogger("services.admission.server")   # the logger name of these lines before the split

Event = tuple[coordinator_pb2.TokenEvent, common_pb2.Receipt | None]   # a token, with the receipt on the last


class FrontDoor:
    """Admission's state and its admit path: `handle` one generate request, `tag` one tag request."""

    def __init__(self, pipelines: Pipelines, model: ModelLimits,
                 model_fingerprint: str, max_concurrent: int = settings.MAX_CONCURRENT_REQUESTS,
                 max_lifetime_s: float = settings.MAX_REQUEST_LIFETIME_S,
                 tag_budget_s: float = settings.TAG_BUDGET_S, work: FrontWork | None = None,
                 metrics: AdmissionMetrics | None = None, tenant_limits: TenantLimits | None = None,
                 api_keys: ApiKeys | None = None, resume_wait_s: float = settings.ADMISSION_RESUME_WAIT_S) -> None:
        self.pipelines = pipelines
        self.resume_wait_s = resume_wait_s   # --resume-wait: how long a dropped request waits for a pipeline
        self.tenant_limits = tenant_limits or TenantLimits()   # no file: no tenant is limited
        self.api_keys = api_keys or ApiKeys()                  # no key configured: the body's tenant stands
        self.model = model
        self.model_fingerprint = model_fingerprint
        # The global cap, shared fairly between tenants (their own max_concurrent from the tenants file).
        self.limit = ConcurrencyShares(max_concurrent,
                                       lambda account: self.tenant_limits.limit_of(account).max_concurrent)
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

    # ---- the two entry points ---------------------------------------------------------------------------

    @asynccontextmanager
    async def handle(self, call: Call, request: admission_pb2.GenerateRequest,
                     ) -> AsyncIterator[tuple[Admitted, Routed, AsyncIterator[Event]]]:
        """One request from arrival to its end, for every face alike: entered, admitted and routed, then its
        (event, receipt) pairs from the coordinator for the face to pass on; on the way out, however it ends,
        its slot and label are released and its outcome closed with the error it ended with. `request` is
        the face's own message: admission sets its tenant from the caller's key."""
        arrived = time.perf_counter()
        outcome = Outcome(self.metrics, call)
        a: Admitted | None = None
        error: BaseException | None = None
        try:
            account = self._enter(outcome, call, request)
            try:
                a = await self._admit(request, outcome, account)
                routed = await self._route(a, call, outcome)
                # aclosing: when the face's task is cancelled (disconnect, deadline) while it waits to send, the
                # inner generator must close now, cancelling the coordinator call, not whenever it is collected.
                async with aclosing(self._generate(request, a, routed, call, outcome, arrived)) as events:
                    yield a, routed, events
            finally:
                self._done(a, account)
        except BaseException as e:
            error = e
            raise
        finally:
            outcome.close(error)

    async def tag(self, call: Call, request: admission_pb2.GenerateRequest) -> Tags:
        """The tags `request` would get: the same checks, limits and CPU work as a request (but readiness)."""
        outcome = Outcome(self.metrics)
        account = self._enter_tenant(outcome, request, self._authenticate(call, outcome))
        try:
            return (await self._admit(request, outcome, account, take_label=False)).tags
        finally:
            self.limit.release(account)

    # ---- steps ------------------------------------------------------------------------------------------

    def _enter(self, outcome: Outcome, call: Call, request: admission_pb2.GenerateRequest) -> str:
        """The caller's key, readiness, then the tenant's rate and a concurrency slot: the account holding it."""
        principal = self._authenticate(call, outcome)
        self._check_ready(outcome)
        return self._enter_tenant(outcome, request, principal)

    def _enter_tenant(self, outcome: Outcome, request: admission_pb2.GenerateRequest,
                      principal: Principal | None) -> str:
        """Before any work: the key's tenant and priorities (with a principal), the tenant's request rate, then a
        slot within its share of the cap (RESOURCE_EXHAUSTED + RetryInfo). The account the slot is held by."""
        if principal is not None:
            self._authorize(request, principal, outcome)
        refusal = self.tenant_limits.admit(request.tenant)
        if refusal is not None:
            self._refuse(outcome, "tenant_limit", grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message,
                         refusal.retry_after_s)
        account = self.tenant_limits.account(request.tenant)
        refusal = self.limit.acquire(account, request.tenant)
        if refusal is not None:
            self._refuse(outcome, refusal.reason, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message,
                         refusal.retry_after_s)
        return account

    def _authenticate(self, call: Call, outcome: Outcome) -> Principal | None:
        """The caller's principal from its API key, or UNAUTHENTICATED; None (anyone) while no key is configured.
        First of all checks: a caller without a key learns nothing, not even readiness, and takes no slot."""
        if not self.api_keys.active:
            return None
        got = self.api_keys.authenticate(call.metadata)
        if isinstance(got, AuthError):
            self._auth_failed(outcome, got)
        return got

    def _authorize(self, request: admission_pb2.GenerateRequest, principal: Principal, outcome: Outcome) -> None:
        """Run the request as the key's tenant (an empty body tenant becomes it), or PERMISSION_DENIED for
        another tenant or a priority the tenant may not use."""
        try:
            priority: str = parse_priority(request.priority)
        except ValueError:
            priority = request.priority   # not a priority at all: validation refuses it with INVALID_ARGUMENT
        got = authorize(principal, request.tenant, priority)
        if isinstance(got, AuthError):
            self._auth_failed(outcome, got)
        request.tenant = got   # the face's own message: the tenant every later step reads

    def _auth_failed(self, outcome: Outcome, error: AuthError) -> NoReturn:
        outcome.auth_failed(error.reason, error.message)
        raise Rejected(error.code, error.message)

    def _check_ready(self, outcome: Outcome) -> None:
        """Never forward while no pipeline serves our model: that answer would be wrong."""
        if not self.ready:   # the reason's addresses are for the log (set_ready), not the caller
            self._refuse(outcome, "not_ready", grpc.StatusCode.UNAVAILABLE,
                         f"admission is not ready: {public.redact(self.not_ready_reason) or 'see its log'}")

    async def _admit(self, request: admission_pb2.GenerateRequest, outcome: Outcome, account: str,
                     take_label: bool = True) -> Admitted:
        """Tokenize, validate and tag (large requests in `account`'s turn for a worker); mint the internal id;
        take the caller's label (released by `_done`)."""
        started = time.time_ns()
        try:
            if self.work is None or self.work.is_inline(request):
                valid, tags = admit(request, self.model)   # small: cheaper now than shipped (< 1 ms)
            else:
                valid, tags = await self.work.run(request, self.tag_budget_s, account)
        except Busy as e:          # waiting behind others is overload, never the prompt's fault
            self._refuse(outcome, "tag_queue", grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_s)
        except ValueError as e:  # ValidationError, or the tagger refusing the sizes it was given
            self._refuse(outcome, "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError:
            self._refuse(outcome, "tag_timeout", grpc.StatusCode.INVALID_ARGUMENT,
                         f"the prompt took longer than {self.tag_budget_s:g} s to tokenize and tag; "
                         f"send a shorter prompt")
        except BrokenProcessPool:
            self._refuse(outcome, "worker_died", grpc.StatusCode.UNAVAILABLE,
                         "admission's tokenizer worker died while handling this request; it was restarted: retry")
        except Exception:   # noqa: BLE001 - a bug must reach the caller as a status that says so (not its repr)
            log.exception("admitting a request failed")
            self._refuse(outcome, "internal", grpc.StatusCode.INTERNAL,
                         public.failure_message(grpc.StatusCode.INTERNAL, ""))
        a = Admitted(uuid.uuid4().hex, valid, tags)
        outcome.admitted(a, self.model_name, self.model_fingerprint, request, started)
        if take_label and valid.request_id:
            key = (valid.tenant, valid.request_id)
            if key in self.labels:
                self._refuse(outcome, "duplicate_label", grpc.StatusCode.ALREADY_EXISTS,
                             f"request_id {valid.request_id!r} is already in flight for tenant "
                             f"{valid.tenant or '(default)'}; use a new request_id per request")
            self.labels[key] = a.internal_id   # checked and taken with no await between
        return a

    def _done(self, a: Admitted | None, account: str) -> None:
        """The request ended, however: free its concurrency slot and its caller label."""
        self.limit.release(account)
        if a is not None and a.valid.request_id:
            key = (a.valid.tenant, a.valid.request_id)
            if self.labels.get(key) == a.internal_id:
                del self.labels[key]

    async def _route(self, a: Admitted, call: Call, outcome: Outcome) -> Routed:
        """The tenant's limits, shedding by priority, then a pipeline: or a refusal with RetryInfo."""
        started = time.time_ns()
        try:
            routed = self._choose(a, call, outcome)
        except BaseException as e:
            outcome.routed(None, started, e)
            raise
        outcome.routed(routed, started)
        return routed

    def _choose(self, a: Admitted, call: Call, outcome: Outcome) -> Routed:
        valid, tags = a.valid, a.tags
        refusal: Refusal | None = shed_by_priority(tags.priority, self.limit.active - 1, self.limit.cap)
        if refusal is not None:
            self._refuse(outcome, f"priority_{tags.priority}", grpc.StatusCode.RESOURCE_EXHAUSTED,
                         refusal.message, refusal.retry_after_s)
        refusal = self.tenant_limits.charge(valid.tenant, len(valid.prompt_token_ids) + tags.output_budget)
        if refusal is not None:
            self._refuse(outcome, "tenant_limit", grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message,
                         refusal.retry_after_s)
        req = RouteRequest(len(valid.prompt_token_ids), tags.output_budget, tags.size_class, tags.priority,
                           routing_key(valid.prompt_token_ids, tags.prefix_key, valid.tenant))
        try:
            return self.pipelines.choose(req, call.time_remaining())
        except Refused as e:
            self._refuse(outcome, f"route_{e.code.name.lower()}", e.code, e.message, e.retry_after_s)
        raise AssertionError("unreachable: _refuse raises")

    @staticmethod
    def _refuse(outcome: Outcome, reason: str, code: grpc.StatusCode, message: str,
                retry_after_s: float | None = None) -> None:
        outcome.refused(reason)
        raise Rejected(code, message, retry_after_s)

    async def _generate(self, request: admission_pb2.GenerateRequest, a: Admitted, routed: Routed, call: Call,
                        outcome: Outcome, arrived: float) -> AsyncGenerator[Event, None]:
        """Yield the coordinator's events in order, the last one with its receipt; raise Rejected on any error.
        `arrived`: time.perf_counter() when the call reached admission (the latency metrics start there).

        A pipeline that drops the request (`Dropped`: its Session broke, it answered UNAVAILABLE) does not end
        it: it continues on another pipeline of our model (or the same one once it serves again) after the
        tokens already passed on (`resume_tokens`), within its deadline and ADMISSION_RESUME_HOPS; the caller
        sees one stream. Each pipeline gets it as a new request (its own id, epoch 1 on its stages)."""
        valid, rid = a.valid, a.internal_id
        logs.set_request(rid, valid.request_id)   # this handler's task: every line it logs carries the id
        passed = list(valid.resume_token_ids)     # output the caller has: what a next pipeline resumes after
        outcome.started(valid.tenant, len(valid.prompt_token_ids), arrived, len(passed))
        how: str | None = "CANCELLED"             # how it ended, for the access log (None: finished)
        try:
            for hop in range(settings.ADMISSION_RESUME_HOPS + 1):
                try:
                    # aclosing: a caller gone mid-stream closes this hop now, cancelling it on its coordinator
                    async with aclosing(self._hop(request, a, routed, call, outcome, passed, hop)) as events:
                        async for event, receipt in events:
                            yield event, receipt
                    how = None
                    return
                except Dropped as dropped:
                    if hop == settings.ADMISSION_RESUME_HOPS:
                        raise Rejected(dropped.code, f"{dropped.message}; it was continued on another pipeline "
                                                     f"{hop} time(s), the most allowed") from None
                    routed = await self._take_over(a, call, dropped, routed.link.address)
                    outcome.resumed(dropped.reason, dropped.message, routed.link.address)
            raise AssertionError("unreachable: the last hop returns or raises")
        except Rejected as e:
            how = e.code.name
            # The detail (addresses, the coordinator's words) goes to this log line, with the request's id and
            # trace id; the caller gets it with its addresses redacted (public.py) and the reference to this line.
            log.warning("request %s (label %r) failed: %s %s", rid, valid.request_id, e.code.name, e.message)
            raise Rejected(e.code, public.failure_message(e.code, e.message, rid), e.retry_after_s) from None
        finally:
            if how is not None:
                outcome.failed(how)
            outcome.ended(rid, "finished" if how is None else how)

    async def _take_over(self, a: Admitted, call: Call, dropped: "Dropped", dropped_by: str) -> Routed:
        """A pipeline for a request another dropped: asked again every ADMISSION_RESUME_POLL_S while none takes
        it, for at most `resume_wait_s` (--resume-wait) and never past the caller's deadline; else the status the caller
        would have got from the pipeline that dropped it (Rejected)."""
        valid, tags = a.valid, a.tags
        req = RouteRequest(len(valid.prompt_token_ids), tags.output_budget, tags.size_class, tags.priority,
                           routing_key(valid.prompt_token_ids, tags.prefix_key, valid.tenant))
        loop = asyncio.get_running_loop()
        # A pipeline that answered UNAVAILABLE already waited out its recovery window: only a pipeline that
        # serves now takes it over. One whose stream broke (a coordinator that died) may be back in a moment.
        wait_s = 0.0 if dropped.reason == "unavailable" else self.resume_wait_s
        give_up = loop.time() + wait_s
        remaining = call.time_remaining()
        if remaining is not None:
            give_up = min(give_up, loop.time() + remaining)
        avoid: str | None = dropped_by
        while True:
            try:
                return self.pipelines.choose(req, call.time_remaining(), avoid=avoid)
            except Refused as e:
                if avoid is not None:   # nothing else takes it: the same pipeline too, once it serves again
                    avoid = None
                    continue
                if loop.time() + settings.ADMISSION_RESUME_POLL_S >= give_up:
                    raise Rejected(dropped.code, f"{dropped.message}; no pipeline took it over in time: "
                                                 f"{e.message}") from None
            await asyncio.sleep(settings.ADMISSION_RESUME_POLL_S)

    async def _hop(self, request: admission_pb2.GenerateRequest, a: Admitted, routed: Routed, call: Call,
                   outcome: Outcome, passed: list[int], hop: int) -> AsyncGenerator[Event, None]:
        """The request on one pipeline: its events (each token appended to `passed` as it is yielded), the last
        one with its receipt; Dropped when the pipeline drops it, Rejected on any other error."""
        valid, tags, rid = a.valid, a.tags, a.internal_id
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(valid.sampling)          # the seed admission drew, on every pipeline
        sampling.max_tokens = tags.output_budget
        # The caller's deadline bounds the request downstream too, so the coordinator stops working on it in
        # time; a caller without one gets the maximum lifetime.
        remaining = call.time_remaining()
        lifetime_applied = remaining is None
        # A new request to each pipeline: its own id (the stages of a pipeline that comes back may still hold
        # the first), the caller's label and the receipt's internal id unchanged.
        submit = coordinator_pb2.SubmitRequest(request_id=rid if hop == 0 else f"{rid}-{hop}",
                                               prompt_token_ids=valid.prompt_token_ids,
                                               sampling=sampling, tenant=valid.tenant, priority=valid.priority,
                                               label=valid.request_id, resume_tokens=passed,
                                               timeout_s=self.max_lifetime_s if lifetime_applied else remaining,
                                               traceparent=outcome.traceparent)
        target = f"coordinator {routed.link.name} ({routed.link.address})"   # for the log, never the caller
        events = routed.link.session.start(submit)
        failure: tuple[grpc.StatusCode, str] | None = None
        dropped: Dropped | None = None
        ended = False            # the coordinator ended the request (last token or a status): nothing to cancel
        finished = False         # ... with its last token
        try:
            while True:
                event = await events.get()
                if isinstance(event, SessionBroken):
                    ended = True
                    failure = (event.code, f"{target} said: {event.details}")
                    dropped = Dropped("session_broken", *failure)
                    break
                if event.status_code:
                    ended = True
                    code = STATUS_CODES.get(event.status_code, grpc.StatusCode.UNKNOWN)
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED and lifetime_applied:
                        failure = (code, f"request ran past admission's maximum lifetime of {self.max_lifetime_s:g} s "
                                         f"(the call set no deadline)")
                    else:
                        failure = (code, f"{target} said: {event.status_message}")
                    if event.handed_back:   # a draining coordinator gave it back unfinished
                        dropped = Dropped("handed_back", *failure)
                    elif code == grpc.StatusCode.UNAVAILABLE:
                        dropped = Dropped("unavailable", *failure)
                    break
                if event.index != outcome.tokens:
                    failure = (grpc.StatusCode.INTERNAL, f"coordinator skipped a token index: expected "
                                                         f"{outcome.tokens}, got {event.index} (request {rid})")
                    break
                outcome.token()
                passed.append(event.token_id)
                if event.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    yield event, None
                    continue
                ended = finished = True
                outcome.finished(FINISH_REASONS.get(event.finish_reason, "unknown"))
                yield event, common_pb2.Receipt(
                    request_id=valid.request_id, prompt_digest=request_digest(request),
                    prompt_tokens=len(valid.prompt_token_ids), context_hash=event.context_hash,
                    output_tokens=outcome.tokens, internal_id=rid,
                    model_fingerprint=routed.link.served_fingerprint or self.model_fingerprint)
                return
        finally:
            # Runs on client disconnect and deadline too (the face's task is cancelled): stop the coordinator's work.
            routed.link.session.end(submit.request_id, cancel=not ended)
            self.pipelines.finished(routed, None if finished else failure[0] if failure else grpc.StatusCode.CANCELLED)
        if dropped is not None:
            raise dropped
        raise Rejected(*failure)


class Dropped(Exception):
    """A pipeline dropped a request it may not have finished (its Session broke, it answered UNAVAILABLE):
    admission continues it elsewhere. `reason` labels tether:requests_resumed_total."""

    def __init__(self, reason: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.reason, self.code, self.message = reason, code, message


def request_digest(request: admission_pb2.GenerateRequest) -> int:
    """The receipt's prompt_digest: of the prompt bytes, or of the conversation as received (docs/PROTOCOL.md)."""
    if request.messages:
        return messages_digest((m.role, m.content) for m in request.messages)
    return prompt_digest(request.prompt)
