"""The Coordinator gRPC service: Submit (stream tokens back), Session (many requests over one stream), Cancel,
Stats, Watch (services/coordinator/load.py) and Drain (services/coordinator/drain.py)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncGenerator, Callable
from typing import cast
from contextlib import aclosing
from dataclasses import dataclass

import grpc

from services.coordinator.drain import Drain
from services.coordinator.driver import DuplicateRequest, Driver, Failure
from services.coordinator.load import LoadWatch
from services.coordinator.pipeline import PipelineDown
from services.coordinator.scheduler import Request
from tether.generation.sequence import Sequence, TokenOut
from tether.model.config import ModelConfig
from tether.model.tokenizer import Tokenizer
from tether import priority, settings
from tether.protocol.hashing import hash_seed
from tether.telemetry import logs, tracing
from tether.telemetry.metrics import CoordinatorMetrics
from tether.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
# A TokenEvents message stays far under the 1 MiB both ends accept (settings.COORDINATOR_MAX_MESSAGE_BYTES).
_BATCH_BYTES = 256 * 1024


def token_event(out: TokenOut, request_id: str = "") -> coordinator_pb2.TokenEvent:
    """A token the driver appended, as the wire sends it to admission (the request id only on a Session,
    where one stream carries every request)."""
    return coordinator_pb2.TokenEvent(request_id=request_id, index=out.index, token_id=out.token_id, text=out.text,
                                      finish_reason=cast(common_pb2.FinishReason, out.finish_reason),
                                      context_hash=out.context_hash)


@dataclass
class Started:
    """A request the driver accepted, and the queue of its events (TokenOut | Failure)."""

    req: Request
    events: asyncio.Queue


class CoordinatorServicer(LoadWatch, coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, driver: Driver, tokenizer: Tokenizer, cfg: ModelConfig, fingerprint: str,
                 max_lifetime_s: float = settings.MAX_REQUEST_LIFETIME_S) -> None:
        self.driver = driver
        self.metrics: CoordinatorMetrics | None = None   # set by main.py with --metrics-port; None: nothing observed
        self.max_lifetime_s = max_lifetime_s
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.drain = Drain(driver, settings.DRAIN_S)   # main.py gives it --drain-seconds and the server's health
        self.on_drained_exit: Callable[[], None] | None = None   # stops the process (a Drain that asks to exit)
        self.stopping = asyncio.Event()   # main.py gives it the server's: Watch and idle Sessions end on it

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
        # Resumed tokens are context like the prompt and checked like it; they confer nothing else.
        resumed = request.resume_tokens
        if len(resumed) >= request.sampling.max_tokens:
            return (f"resume_tokens holds {len(resumed)} tokens; a resumed request must have fewer than its "
                    f"max_tokens ({request.sampling.max_tokens}) left to continue from")
        if resumed and max(resumed) >= self.cfg.vocab_size:
            return f"resume_tokens has a token id >= the vocabulary size {self.cfg.vocab_size}"
        return None

    def start(self, request: coordinator_pb2.SubmitRequest) -> "Started | Failure":
        """Check a SubmitRequest and start it in the driver: the request and its events, or the Failure that
        refuses it (the same for Submit and the Session)."""
        error = self._validate(request)
        if error:
            return Failure(grpc.StatusCode.INVALID_ARGUMENT, error)
        try:
            req = self._request(request)
        except ValueError as e:   # resume_tokens that already end the generation
            return Failure(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            events = self.driver.submit(req, request.traceparent, request.label)
        except PipelineDown as e:
            return Failure(grpc.StatusCode.UNAVAILABLE, str(e))
        except DuplicateRequest as e:
            return Failure(grpc.StatusCode.ALREADY_EXISTS, str(e))
        if self.metrics is not None:
            self.metrics.submitted(req.id)
        return Started(req, events)

    async def follow(self, started: "Started", timeout_s: float | None, given: bool = True,
                     ) -> AsyncGenerator[TokenOut | Failure, None]:
        """A started request's events to its end: TokenOuts, the last with its finish reason, or a Failure (the
        driver's, or DEADLINE_EXCEEDED past `timeout_s` seconds; None: no limit of our own, a gRPC deadline
        bounds the call). However the consumer stops (its call cancelled, the stream gone), the request is
        cancelled in the driver, so nothing keeps working for a caller that left. `given`: whether the
        timeout is the caller's deadline (False: the coordinator's maximum lifetime)."""
        req, events = started.req, started.events
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s if timeout_s is not None else None
        ended = False
        failed: str | None = None   # the status code name of a Failure, for the metrics
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):   # around the wait only: never around a yield
                        ev = await events.get()
                except TimeoutError:   # ours, not the driver's: `ended` stays False, so it is cancelled there
                    failed = grpc.StatusCode.DEADLINE_EXCEEDED.name
                    yield Failure(grpc.StatusCode.DEADLINE_EXCEEDED, (
                        f"request {req.id} ran past its deadline of {timeout_s:g} s" if given else
                        f"request {req.id} ran past the coordinator's maximum lifetime of {timeout_s:g} s (the "
                        f"caller set no deadline)"))
                    return
                if isinstance(ev, Failure):
                    ended, failed = True, ev.code.name
                else:
                    ended = bool(ev.finish_reason)
                yield ev
                if ended:
                    return
        finally:
            if not ended:   # the caller went away, the call was cancelled or ran out of time: free it now
                self.driver.cancel(req.id, only=req)
            if self.metrics is not None:
                self.metrics.ended(req.id, failed)

    async def Submit(self, request, context):
        logs.set_request(request.request_id, request.label)
        if request.traceparent:   # the caller's context: its trace id until ours exists (same trace)
            c = tracing.span_context(request.traceparent)
            logs.TRACE_ID.set(f"{c.trace_id:032x}" if c is not None and tracing.TRACER is not None else None)
        started = self.start(request)
        if isinstance(started, Failure):
            await context.abort(started.code, started.message)
            return   # abort raises: this tells the type checker
        # A caller that set no deadline still gets one: nothing waits forever on a wedged request. (A gRPC
        # deadline, which admission always sets, cancels this handler by itself.)
        timeout_s = self.max_lifetime_s if context.time_remaining() is None else None
        async with aclosing(self.follow(started, timeout_s, given=False)) as events:
            async for ev in events:
                if isinstance(ev, Failure):
                    await context.abort(ev.code, ev.message)
                    return   # abort raises
                yield token_event(ev)

    def _request(self, request: coordinator_pb2.SubmitRequest) -> Request:
        """The request's Sequence, started after its resumed tokens (ValueError: they already end it)."""
        seq = Sequence(request.request_id, list(request.prompt_token_ids), request.sampling, self.tokenizer,
                       hash_seed(self.fingerprint, request.tenant), self.cfg.max_position_embeddings)
        seq.resume(list(request.resume_tokens))
        return Request(seq, tenant=request.tenant, priority=priority.from_peer(request.priority))

    async def Session(self, request_iterator, context):
        await _Session(self, context).run(request_iterator)

    async def Cancel(self, request, context):
        return coordinator_pb2.CancelReply(found=self.driver.cancel(request.request_id))

    async def Drain(self, request, context):
        seconds = request.deadline_seconds
        if not math.isfinite(seconds) or not 0 <= seconds <= settings.MAX_REQUEST_LIFETIME_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                f"deadline_seconds must be 0 (the coordinator's --drain-seconds) to "
                f"{settings.MAX_REQUEST_LIFETIME_S:g}, not {seconds!r}"))
            return   # abort raises
        started = self.drain.start(seconds)
        log.info("Drain called by %s: %s", context.peer(), "started" if started else "already draining")
        task = self.drain.task
        if request.exit and self.on_drained_exit is not None and task is not None:
            stop = self.on_drained_exit
            task.add_done_callback(lambda _: stop())
        return coordinator_pb2.DrainReply(draining=True, started=started, running=len(self.driver.active()),
                                          deadline_seconds=self.drain.seconds_left())

    async def Stats(self, request, context):
        e, c = self.driver, self.driver.counters
        f, ledger = e.sched.figures, e.sched.ledger
        return coordinator_pb2.StatsReply(
            serving=e.serving and not e.draining, draining=e.draining, model_fingerprint=self.fingerprint, num_stages=e.pipeline.num_stages,
            running=len(e.sched.running), waiting=len(e.sched.waiting), tokens_generated=c.tokens,
            requests_finished=c.finished, requests_failed=c.failed, slots_rejected=sum(c.rejections.values()),
            pipeline_epoch=e.pipeline.epoch, status="draining" if e.draining else e.status, max_context=self.cfg.max_position_embeddings,
            rejections=dict(c.rejections), rebuilds=c.rebuilds, resumes=c.resumes, recovered=c.recovered,
            pipeline_reconnects=c.reconnects, stamp_checks=e.stamp_checks,
            faults_injected={k: v for k, v in e.pipeline.faults.counts.items() if v},
            preempted=e.sched.num_preempted, preemptions=f.preemptions, kv_blocks_used=ledger.used,
            kv_blocks_cached=ledger.cached, kv_blocks_total=min(ledger.capacity, 2**32 - 1),
            prefix_queries=f.prefix_queries, prefix_hits=f.prefix_hits, prefix_hit_tokens=f.prefix_hit_tokens,
            prefix_misses=c.prefix_misses, prompt_tokens=f.prompt_tokens, computed_tokens=f.computed_tokens,
            step_seconds=e.step_seconds, prefix_cache=e.prefix_cache, watchers=self.watchers)


class _Session:
    """One Session stream: starts the requests it carries, follows each one's events and writes whatever is
    ready as one TokenEvents message. Per request, the same routine as Submit (`start`, `follow`): the same
    checks, events, deadline and cancellation; a request still running when the stream ends is cancelled."""

    def __init__(self, svc: CoordinatorServicer, context: grpc.aio.ServicerContext) -> None:
        self.svc, self.context = svc, context
        self.loop = asyncio.get_running_loop()
        self.out: list[coordinator_pb2.TokenEvent] = []
        self.ready = asyncio.Event()
        self.follows: dict[str, asyncio.Task] = {}     # request id -> the task following its events

    def _emit(self, event: coordinator_pb2.TokenEvent) -> None:
        self.out.append(event)
        self.ready.set()

    def _fail(self, rid: str, code: grpc.StatusCode, message: str, handed_back: bool = False) -> None:
        self._emit(coordinator_pb2.TokenEvent(request_id=rid, status_code=code.value[0], status_message=message,
                                              handed_back=handed_back))

    def _start(self, request: coordinator_pb2.SubmitRequest) -> None:
        rid = request.request_id
        started = self.svc.start(request)
        if isinstance(started, Failure):
            self._fail(rid, started.code, started.message)
            return
        given = request.timeout_s > 0
        timeout_s = request.timeout_s if given else self.svc.max_lifetime_s
        self.follows[rid] = asyncio.create_task(self._follow(rid, request.label, started, timeout_s, given))

    def _cancel(self, rid: str) -> None:
        task = self.follows.get(rid)
        if task is not None:
            task.cancel()      # its follow() cancels the request in the driver

    async def _follow(self, rid: str, label: str, started: Started, timeout_s: float, given: bool) -> None:
        logs.set_request(rid, label)   # this task's own context: its log lines carry the request's id
        if self.svc.driver.traces:
            spans = self.svc.driver.traces.get(rid)
            logs.TRACE_ID.set(spans.trace_id if spans is not None else None)
        try:
            async with aclosing(self.svc.follow(started, timeout_s, given)) as events:
                async for ev in events:
                    if isinstance(ev, Failure):
                        self._fail(rid, ev.code, ev.message, ev.handed_back)
                    else:
                        self._emit(token_event(ev, rid))
        finally:
            if self.follows.get(rid) is asyncio.current_task():
                del self.follows[rid]
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
        stopping = asyncio.create_task(self.svc.stopping.wait())   # the server stops: end once nothing is left
        stopping.add_done_callback(lambda _: self.ready.set())
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
                if stopping.done() and not self.follows:   # drained: every request ended or was handed back
                    return
        finally:
            stopping.cancel()
            reader.cancel()
            for task in list(self.follows.values()):
                task.cancel()
