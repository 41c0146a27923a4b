"""The Coordinator gRPC service: Submit (stream tokens back), Session (many requests over one stream), Cancel,
Stats."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.coordinator.driver import DuplicateRequest, Driver, Failure
from services.coordinator.load import LoadWatch
from services.coordinator.pipeline import PipelineDown
from services.coordinator.scheduler import Request
from tether.generation.sequence import Sequence, TokenOut
from tether.model.config import ModelConfig
from tether.model.tokenizer import Tokenizer
from tether import settings
from tether.protocol.hashing import hash_seed
from tether.telemetry import logs, tracing
from tether.telemetry.metrics import CoordinatorMetrics
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
# A TokenEvents message stays far under the 1 MiB both ends accept (settings.COORDINATOR_MAX_MESSAGE_BYTES).
_BATCH_BYTES = 256 * 1024


def token_event(out: TokenOut, request_id: str = "") -> coordinator_pb2.TokenEvent:
    """A token the driver appended, as the wire sends it to admission (the request id only on a Session,
    where one stream carries every request)."""
    return coordinator_pb2.TokenEvent(request_id=request_id, index=out.index, token_id=out.token_id, text=out.text,
                                      finish_reason=out.finish_reason, context_hash=out.context_hash)


class CoordinatorServicer(LoadWatch, coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, driver: Driver, tokenizer: Tokenizer, cfg: ModelConfig, fingerprint: str,
                 max_lifetime_s: float = settings.MAX_REQUEST_LIFETIME_S) -> None:
        self.driver = driver
        self.metrics: CoordinatorMetrics | None = None   # set by main.py with --metrics-port; None: nothing observed
        self.max_lifetime_s = max_lifetime_s
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.fingerprint = fingerprint

    def _validate(self, request: coordinator_pb2.SubmitRequest) -> str | None:
        n = len(request.prompt_token_ids)
        if not request.request_id or len(request.request_id) > settings.MAX_REQUEST_ID_CHARS:
            return (f"request_id must be 1 to {settings.MAX_REQUEST_ID_CHARS} characters (admission mints one "
                    f"per request)")
        if n == 0:
            return "prompt_token_ids is empty"
        if max(request.prompt_token_ids) >= self.cfg.vocab_size:
            return f"prompt has a token id >= the vocabulary size {self.cfg.vocab_size}"
        if request.sampling.max_tokens < 1:
            return "sampling.max_tokens must be at least 1"
        if n + request.sampling.max_tokens > self.cfg.max_position_embeddings:
            return (f"prompt ({n} tokens) + max_tokens ({request.sampling.max_tokens}) exceeds the context "
                    f"window of {self.cfg.max_position_embeddings}")
        if request.sampling.temperature < 0:
            return "sampling.temperature must be >= 0"
        return None

    async def Submit(self, request, context):
        error = self._validate(request)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        rid = request.request_id
        logs.set_request(rid, request.label)
        req = self._request(request)
        if request.traceparent:   # the caller's context: its trace id until ours exists (same trace)
            c = tracing.span_context(request.traceparent)
            logs.TRACE_ID.set(f"{c.trace_id:032x}" if c is not None and tracing.TRACER is not None else None)
        try:
            events = self.driver.submit(req, request.traceparent, request.label)
        except PipelineDown as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except DuplicateRequest as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        failed: str | None = None   # the status code name of a Failure, for the metrics
        if self.metrics is not None:
            self.metrics.submitted(rid)
        # A caller that set no deadline still gets one: nothing waits forever on a wedged request. (A gRPC
        # deadline, which admission always sets, cancels this handler by itself.)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_lifetime_s if context.time_remaining() is None else None
        finished = False
        try:
            while True:
                if deadline is None:
                    ev = await events.get()
                else:
                    try:
                        ev = await asyncio.wait_for(events.get(), deadline - loop.time())
                    except TimeoutError:
                        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                            f"request {rid} ran past the coordinator's maximum lifetime of "
                                            f"{self.max_lifetime_s:g} s (the caller set no deadline)")
                if isinstance(ev, Failure):
                    finished = True
                    failed = ev.code.name
                    await context.abort(ev.code, ev.message)
                yield token_event(ev)
                if ev.finish_reason:
                    finished = True
                    return
        finally:
            if not finished:   # client went away, the call was cancelled or ran out of time: free it now
                self.driver.cancel(rid, only=req)
            if self.metrics is not None:
                self.metrics.ended(rid, failed)

    def _request(self, request: coordinator_pb2.SubmitRequest) -> Request:
        seq = Sequence(request.request_id, list(request.prompt_token_ids), request.sampling, self.tokenizer,
                       hash_seed(self.fingerprint, request.tenant), self.cfg.max_position_embeddings)
        return Request(seq, tenant=request.tenant, priority=request.priority or "standard")

    async def Session(self, request_iterator, context):
        await _Session(self, context).run(request_iterator)

    async def Cancel(self, request, context):
        return coordinator_pb2.CancelReply(found=self.driver.cancel(request.request_id))

    async def Stats(self, request, context):
        e, c = self.driver, self.driver.counters
        f, ledger = e.sched.figures, e.sched.ledger
        return coordinator_pb2.StatsReply(
            serving=e.serving, model_fingerprint=self.fingerprint, num_stages=e.pipeline.num_stages,
            running=len(e.sched.running), waiting=len(e.sched.waiting), tokens_generated=c.tokens,
            requests_finished=c.finished, requests_failed=c.failed, slots_rejected=sum(c.rejections.values()),
            pipeline_epoch=e.pipeline.epoch, status=e.status, max_context=self.cfg.max_position_embeddings,
            rejections=dict(c.rejections), rebuilds=c.rebuilds, resumes=c.resumes, recovered=c.recovered,
            pipeline_reconnects=c.reconnects, stamp_checks=e.stamp_checks,
            faults_injected={k: v for k, v in e.pipeline.faults.counts.items() if v},
            preempted=e.sched.num_preempted, preemptions=f.preemptions, kv_blocks_used=ledger.used,
            kv_blocks_cached=ledger.cached, kv_blocks_total=min(ledger.capacity, 2**32 - 1),
            prefix_queries=f.prefix_queries, prefix_hits=f.prefix_hits, prefix_hit_tokens=f.prefix_hit_tokens,
            prefix_misses=c.prefix_misses, prompt_tokens=f.prompt_tokens, computed_tokens=f.computed_tokens,
            step_seconds=e.step_seconds, prefix_cache=e.prefix_cache)


class _Session:
    """One Session stream: starts the requests it carries, follows each one's events and writes whatever is
    ready as one TokenEvents message. Per request, the same checks, events, deadline and cancellation as
    Submit; a request still running when the stream ends is cancelled."""

    def __init__(self, svc: CoordinatorServicer, context: grpc.aio.ServicerContext) -> None:
        self.svc, self.context = svc, context
        self.loop = asyncio.get_running_loop()
        self.out: list[coordinator_pb2.TokenEvent] = []
        self.ready = asyncio.Event()
        self.follows: dict[str, asyncio.Task] = {}     # request id -> the task following its events

    def _emit(self, event: coordinator_pb2.TokenEvent) -> None:
        self.out.append(event)
        self.ready.set()

    def _fail(self, rid: str, code: grpc.StatusCode, message: str) -> None:
        self._emit(coordinator_pb2.TokenEvent(request_id=rid, status_code=code.value[0], status_message=message))

    def _start(self, request: coordinator_pb2.SubmitRequest) -> None:
        rid = request.request_id
        error = self.svc._validate(request)
        if error:
            self._fail(rid, grpc.StatusCode.INVALID_ARGUMENT, error)
            return
        req = self.svc._request(request)
        try:
            events = self.svc.driver.submit(req, request.traceparent, request.label)
        except PipelineDown as e:
            self._fail(rid, grpc.StatusCode.UNAVAILABLE, str(e))
            return
        except DuplicateRequest as e:
            self._fail(rid, grpc.StatusCode.ALREADY_EXISTS, str(e))
            return
        if self.svc.metrics is not None:
            self.svc.metrics.submitted(rid)
        timeout_s = request.timeout_s if request.timeout_s > 0 else self.svc.max_lifetime_s
        self.follows[rid] = asyncio.create_task(self._follow(rid, request.label, req, events, timeout_s,
                                                             request.timeout_s > 0))

    def _cancel(self, rid: str) -> None:
        task = self.follows.get(rid)
        if task is not None:
            task.cancel()      # its finally cancels the request in the driver

    def _expire(self, rid: str, timeout_s: float, given: bool) -> None:
        task = self.follows.get(rid)
        if task is None:
            return
        why = (f"request {rid} ran past its deadline of {timeout_s:g} s" if given else
               f"request {rid} ran past the coordinator's maximum lifetime of {timeout_s:g} s (the caller set "
               f"no deadline)")
        self._fail(rid, grpc.StatusCode.DEADLINE_EXCEEDED, why)
        task.cancel()

    async def _follow(self, rid: str, label: str, req: Request, events: asyncio.Queue, timeout_s: float,
                      given: bool) -> None:
        logs.set_request(rid, label)   # this task's own context: its log lines carry the request's id
        if self.svc.driver.traces:
            spans = self.svc.driver.traces.get(rid)
            logs.TRACE_ID.set(spans.trace_id if spans is not None else None)
        finished = False
        failed: str | None = None      # the status code name of a Failure, for the metrics
        timer = self.loop.call_later(timeout_s, self._expire, rid, timeout_s, given)
        try:
            while True:
                ev = await events.get()
                if isinstance(ev, Failure):
                    finished = True
                    failed = ev.code.name
                    self._fail(rid, ev.code, ev.message)
                    return
                self._emit(token_event(ev, rid))
                if ev.finish_reason:
                    finished = True
                    return
        finally:
            timer.cancel()
            if self.follows.get(rid) is asyncio.current_task():
                del self.follows[rid]
            if not finished:   # cancelled, expired or the stream ended: free it now
                self.svc.driver.cancel(rid, only=req)
            if self.svc.metrics is not None:
                self.svc.metrics.ended(rid, failed)
            if not self.follows:
                self.ready.set()   # the writer checks whether the stream is done

    async def _read(self, request_iterator) -> None:
        async for msg in request_iterator:
            for request in msg.submit:
                self._start(request)
            for rid in msg.cancel:   # after the submits: a request may be cancelled in the message that starts it
                self._cancel(rid)
        self.ready.set()

    async def run(self, request_iterator) -> None:
        reader = asyncio.create_task(self._read(request_iterator))
        reader.add_done_callback(lambda _: self.ready.set())
        try:
            while True:
                await self.ready.wait()
                self.ready.clear()
                while self.out:
                    size, n = 0, 0
                    while n < len(self.out) and (n == 0 or size < _BATCH_BYTES):
                        size += 4 * (len(self.out[n].text) + len(self.out[n].status_message)) + 64   # UTF-8 at most
                        n += 1
                    batch, self.out = self.out[:n], self.out[n:]
                    await self.context.write(coordinator_pb2.TokenEvents(events=batch))
                if reader.done():
                    if not reader.cancelled() and reader.exception() is not None:
                        await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                                 f"malformed Session stream: {reader.exception()!r}")
                    if not self.follows:   # the caller closed its side and every request has ended
                        return
        finally:
            reader.cancel()
            for task in list(self.follows.values()):
                task.cancel()
