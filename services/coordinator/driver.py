"""The driver loop: feeds micro-batches into the pipeline, checks every echoed stamp, appends tokens, and
recovers a request's state when anything goes wrong (docs/PROTOCOL.md "Recovery").

- A rejected slot, a wrong echo or a missing result: the request is rebuilt (new request epoch, whole
  context replayed from position 0).
- A frame unanswered for `frame_timeout_s`: its requests are synced (SyncState on every stage) and resumed
  where every stage agrees with the coordinator's record, else rebuilt.
- A broken pipeline (stream failed, stage died): the driver re-handshakes until the route is back, syncs
  every active request and continues; requests fail with UNAVAILABLE only after `recovery_window_s`.
Tokens already sent to a client never change: a rebuild replays them as context, and sampling is keyed
by (seed, position), so generation continues exactly where it was.

Every path that ends a request (finish, cancel, failure, a crash of this loop) queues a Release of its
state on every stage, at once or, when it ended with a frame in flight, once that frame is over (the
request's Phase decides: services/coordinator/scheduler.py); `run` is supervised (tether/supervise.py): an unexpected error fails the active
requests with INTERNAL, turns health NOT_SERVING and restarts the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from services.coordinator.health import PipelineHealth
from services.coordinator.inflight import FramesInFlight
from services.coordinator.pipeline import Pipeline, PipelineDown, alone_limit
from services.coordinator.releases import ReleaseQueue
from services.coordinator.request_spans import RequestSpans
from services.coordinator.scheduler import Phase, Request, Scheduler
from services.coordinator.verdict import Verdict, describe_held, held_everywhere, judge
from tether import settings
from tether.generation.sequence import TokenOut
from tether.telemetry import tracing
from tether.v1 import stage_pb2

log = logging.getLogger(__name__)


class DuplicateRequest(Exception):
    """A request id that is already active: ids key every piece of state, so they must be unique."""


@dataclass
class Failure:
    code: grpc.StatusCode
    message: str
    handed_back: bool = False   # unfinished, given back while draining: admission continues it elsewhere


@dataclass
class Counters:
    tokens: int = 0
    finished: int = 0
    failed: int = 0
    rebuilds: int = 0
    resumes: int = 0
    recovered: int = 0
    reconnects: int = 0
    prefix_misses: int = 0
    rejections: Counter = field(default_factory=Counter)   # reason name -> slots


def _trusted(req: Request, res: stage_pb2.SlotResult) -> bool:
    """The unsafe experiment's reply check: none."""
    return True


class Driver:
    def __init__(self, pipeline: Pipeline, max_slots: int = settings.MAX_BATCH_SLOTS,
                 max_tokens: int = settings.MAX_BATCH_TOKENS, frame_timeout_s: float = settings.FRAME_TIMEOUT_S,
                 recovery_window_s: float = settings.RECOVERY_WINDOW_S, max_rebuilds: int = settings.MAX_REBUILDS,
                 stamp_checks: bool = True, on_serving: Callable[[bool], Awaitable[None]] | None = None,
                 stream_idle_s: float = settings.STREAM_IDLE_S, prefix_cache: bool = True,
                 alone_max: int | None = None):
        self.pipeline = pipeline
        self.sched = Scheduler(pipeline.num_stages, max_slots, max_tokens)
        self.alone_max = alone_max   # the scheduler's (None: by the stages' inputs, `alone_limit`)
        self.max_slots, self.max_tokens = max_slots, max_tokens   # ours; the route's limits may lower them
        self.frame_timeout_s = frame_timeout_s
        self.recovery_window_s = recovery_window_s
        self.max_rebuilds = max_rebuilds
        # False only under --unsafe-disable-stamp-checks (experiment only), decided here once: every echo and
        # token is then taken as it comes (_trusted), which shows the wrong answers the checks prevent.
        self.stamp_checks = stamp_checks
        self._echo_ok = self._echo_matches if stamp_checks else _trusted
        self._token_ok = self._token_hash_matches if stamp_checks else _trusted
        # send cached prefixes the stages hold (False: --no-prefix-cache; and without the stamp checks, whose
        # stages keep no prefix cache: services/stage_worker/unchecked.py)
        self.prefix_cache = prefix_cache and stamp_checks
        self.keepalive_s = stream_idle_s / 3   # the stages close a stream idle for stream_idle_s
        self.sinks: dict[str, asyncio.Queue] = {}   # request id -> events (TokenOut | Failure)
        self.delivered: list[tuple[asyncio.Queue, TokenOut]] = []   # tokens of the reply being settled
        self.frames = FramesInFlight()
        self.releases = ReleaseQueue()
        self.wake = asyncio.Event()
        self.health = PipelineHealth(on_serving, self._spawn)
        self.counters = Counters()
        self._background: set[asyncio.Task] = set()
        self.on_batch: Callable[[list[Request]], None] = lambda batch: None   # telemetry hook: a frame's requests
        # Traced requests only (tracing on and sampled): empty otherwise, and every tracing path of the loop
        # starts with `if self.traces:`, so with tracing off nothing else runs.
        self.traces: dict[str, RequestSpans] = {}
        self.draining = False   # told to drain: no new request; what is left at the end is handed back

    @property
    def serving(self) -> bool:
        return self.health.serving

    @property
    def status(self) -> str:
        return self.health.status

    @property
    def step_seconds(self) -> float:
        """Recent mean time from a frame's send to its reply."""
        return self.frames.step_seconds

    # --- requests ---------------------------------------------------------------------------------------
    def submit(self, req: Request, traceparent: str = "", label: str = "") -> asyncio.Queue:
        """Start a request; `traceparent` (admission's span of it) parents its spans when tracing is on."""
        if self.draining:
            raise PipelineDown("coordinator is draining (shutting down): send the request to another pipeline")
        if not self.serving:
            raise PipelineDown(f"pipeline not serving: {self.status}")
        if req.id in self.sinks or req.id in self.sched.running:
            raise DuplicateRequest(f"request id {req.id} is already in flight")
        q: asyncio.Queue = asyncio.Queue()
        self.sinks[req.id] = q
        if tracing.TRACER is not None:
            spans = RequestSpans(req, traceparent, label)
            if spans.traceparent:
                self.traces[req.id] = spans
            else:            # not sampled: close the non-recording spans now, nothing else follows them
                spans.end(req, None)
        self.sched.add(req)
        self.wake.set()
        return q

    def cancel(self, request_id: str, only: Request | None = None) -> bool:
        """Stop a request (client gone or Cancel); its state is released once no frame of it is in flight.
        With `only`, stop it only if the active request of that id is that very object."""
        req = self.sched.running.get(request_id) or next((r for r in self.sched.waiting if r.id == request_id), None)
        if req is None or (only is not None and req is not only):
            return False
        sink = self.sinks.get(request_id)
        self._finish(req, None)
        if sink is not None:   # a Submit still streaming (a Cancel RPC, not its own client leaving) ends now
            sink.put_nowait(Failure(grpc.StatusCode.CANCELLED, f"request {request_id} was cancelled"))
        return True

    def hand_back(self) -> int:
        """Draining is over: every request still active ends with UNAVAILABLE marked handed back (admission
        continues it on another pipeline after the tokens it has), its state released. How many."""
        left = self.active()
        for req in left:
            self._finish(req, Failure(grpc.StatusCode.UNAVAILABLE, f"request {req.id} handed back unfinished after "
                                      f"{len(req.seq.output_ids)} token(s): the coordinator is draining",
                                      handed_back=True))
        return len(left)

    def active(self) -> list[Request]:
        return [*self.sched.running.values(), *self.sched.waiting]

    def _finish(self, req: Request, failure: Failure | None) -> None:
        release = self.sched.remove(req)   # Request.end: released now, or once its frame is over
        if self.traces:
            spans = self.traces.pop(req.id, None)
            if spans is not None:
                spans.end(req, failure)
        q = self.sinks.pop(req.id, None)
        if failure is not None:
            self.counters.failed += 1
            if q is not None:
                q.put_nowait(failure)
        if release:
            self._queue_release(req)
        self.wake.set()

    def _queue_release(self, req: Request) -> None:
        """Free an ended request's state on every stage (soon, from the feed loop); the ledger counts its blocks
        held until every stage has answered."""
        self.sched.ledger.release_begin(req.id)
        self.sched.ended[req.id] = req
        self.releases.add(req.id)

    def _frame_over(self, req: Request, lost: bool = False) -> bool:
        """The frame `req` had in flight is over: answered, forgotten with the stream, or (`lost`) given up on
        and to be synced. A request that ended meanwhile is released now (`Request.frame_over`: the rule lives
        there, once). True when it had ended: nothing else is to be done with it."""
        if req.lose() if lost else req.frame_over():
            self._queue_release(req)
        return req.done

    # --- the loop ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self.pipeline.connect()
            except PipelineDown as e:
                self._unavailable(str(e))
                await asyncio.sleep(settings.RECONNECT_INTERVAL_S)
                continue
            self._apply_stage_limits()
            await self.health.up()
            log.info("pipeline serving: %s", ", ".join(
                f"{s.address}[{s.layer_start},{s.layer_end})" for s in self.pipeline.stages))
            try:
                if self.health.recovering:
                    self.health.recovered()
                    self.counters.reconnects += 1
                    await self._resync([r for r in self.sched.running.values() if not r.done])
                async with asyncio.TaskGroup() as tg:   # one failing task cancels the others
                    tg.create_task(self._feed())
                    tg.create_task(self._receive())
                    tg.create_task(self._watchdog())
            except* PipelineDown as eg:
                self._broken(str(eg.exceptions[0]))
            finally:
                self.pipeline.close_stream()
            await asyncio.sleep(settings.RECONNECT_INTERVAL_S)

    def _apply_stage_limits(self) -> None:
        """Never send a frame a stage said (at handshake) it would refuse, nor a block it cannot hold."""
        slots, rows = self.pipeline.frame_limits()
        self.sched.max_slots = min(self.max_slots, slots) if slots else self.max_slots
        self.sched.max_tokens = min(self.max_tokens, rows) if rows else self.max_tokens
        block = self.pipeline.stages[0].kv_block_tokens   # the same on every stage (Pipeline.connect checked)
        capacity = min(s.kv_capacity_tokens // block for s in self.pipeline.stages)
        self.sched.ledger.configure(capacity, block, self.prefix_cache)
        # One micro-batch in flight while few requests are active, only where every stage then takes more cores
        self.sched.alone_max = alone_limit(self.pipeline.stages, self.alone_max)

    async def crashed(self, error: BaseException) -> None:
        """The loop died of an unexpected error (a bug, a peer answering outside the contract): fail every
        active request explicitly, free their state, and report NOT_SERVING until the restarted loop has
        handshaken again. Nothing waits on a loop that is gone."""
        if isinstance(error, BaseExceptionGroup):
            error = error.exceptions[0]
        why = f"coordinator driver failed: {type(error).__name__}: {error}"
        self.health.down(f"restarting: {why}")
        self.pipeline.close_stream()
        self._forget_frames()   # first: a request ended while in flight is released, the rest settle
        for req in self.active():
            self._finish(req, Failure(grpc.StatusCode.INTERNAL, f"{why}; the request was stopped"))
        self.health.recovered()
        ids = self.releases.take()
        if ids:
            try:
                await self.pipeline.release(ids)
            except Exception:   # noqa: BLE001 - best effort; the stages' leases are the backstop
                log.warning("release of %d request(s) after the crash failed", len(ids))
            for rid in ids:
                self.sched.released(rid)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)            # held so it is not collected mid-flight
        task.add_done_callback(self._background.discard)

    def _broken(self, why: str) -> None:
        """The stream broke: keep requests, forget frames in flight (their outcome is unknown until a sync)."""
        log.warning("pipeline broken, recovering: %s", why)
        self.health.broken(why)
        self._forget_frames()

    def _forget_frames(self) -> None:
        """The stream is gone: no frame is in flight any more (their outcome is unknown until a sync)."""
        for batch in self.frames.forget():
            for req in batch:
                if req.phase in (Phase.IN_FLIGHT, Phase.ENDING):   # not one the watchdog gave up on already
                    self._frame_over(req)
        self.sched.frames_lost()

    def _unavailable(self, why: str) -> None:
        """No pipeline: fail queued work at once, in-flight work once the recovery window has passed."""
        if self.serving or self.status != why:
            log.warning("pipeline down: %s", why)
        self.health.down(f"recovering: {why}" if self.health.recovering else why)
        expired = self.health.waited_past(self.recovery_window_s)
        for req in list(self.sched.waiting) + (list(self.sched.running.values()) if expired else []):
            self._finish(req, Failure(grpc.StatusCode.UNAVAILABLE, f"pipeline failed during generation: {why}"))
        if expired:
            self.health.recovered()

    async def _feed(self) -> None:
        while True:
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that arrives as
                # the event is set, and a feed loop that outlives its cancellation hangs the shutdown
                async with asyncio.timeout(self.keepalive_s):
                    await self.wake.wait()
            except TimeoutError:
                if not self.frames:   # idle: an empty frame keeps the stages from closing the stream
                    frame = self.pipeline.frame([])
                    self.frames.sent(frame.stream_seq, [])
                    await self.pipeline.send(frame)
                continue
            self.wake.clear()
            if self.releases:
                self._spawn(self._release(self.releases.take()))
            while batch := self.sched.next_batch():
                self._after_schedule()
                slots = [stage_pb2.Slot(stamp=r.sent, sampling=r.seq.sampling, sample=r.samples,
                                        hash_seed=r.seq.hash_seed, cached_prefix=r.cached) for r in batch]
                if self.traces:
                    self._trace_frame(batch, slots)
                frame = self.pipeline.frame(slots)
                frame.frames_in_flight = self.sched.frames_in_flight   # this one included: 1 = alone
                self.frames.sent(frame.stream_seq, batch)
                self.on_batch(batch)
                await self.pipeline.send(frame)
            self._after_schedule()
            if self.releases:
                self._spawn(self._release(self.releases.take()))

    def _trace_frame(self, batch: list[Request], slots: list[stage_pb2.Slot]) -> None:
        """Tracing on: each traced request's slot carries its span's traceparent (for the stages) and its
        prefill chunks are events; decode frames add nothing here."""
        for req, slot in zip(batch, slots):
            spans = self.traces.get(req.id)
            if spans is not None:
                slot.traceparent = spans.traceparent
                if spans.phase_name != "decode":
                    spans.sent(req, slot.stamp)

    def _trace_event(self, req: Request, name: str, reason: str, detail: str) -> None:
        spans = self.traces.get(req.id)
        if spans is not None:
            spans.event(name, reason, detail, req)

    def _log_extra(self, req: Request) -> dict | None:
        """The JSON logs' trace_id of a line about a traced request (driver lines are logged outside its task)."""
        spans = self.traces.get(req.id) if self.traces else None
        return {"trace_id": spans.trace_id} if spans is not None else None

    def _after_schedule(self) -> None:
        """What scheduling decided besides the batch: Releases for the preempted, failures for the requests
        no stage could ever hold."""
        s = self.sched
        for req in s.preempted:
            log.info("request %s preempted: KV blocks are needed by an older or higher-priority request", req.id,
                     extra=self._log_extra(req))
            if self.traces:
                self._trace_event(req, "preempted", "KV_BLOCKS", "KV blocks are needed by an older or "
                                                                 "higher-priority request; recomputed later")
            self.releases.add(req.id)     # its blocks are already `releasing` in the ledger (PREEMPTED)
        s.preempted.clear()
        for req in s.impossible:
            self._finish(req, Failure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"request needs {req.final_positions} context positions of KV; this "
                                      f"pipeline's stages hold at most {s.ledger.capacity * s.ledger.block}"))
        s.impossible.clear()

    async def _release(self, ids: list[str]) -> None:
        """Release on every stage; ids a stage failed to release are queued again, a few times at most."""
        freed, given_up = self.releases.answered(ids, await self.pipeline.release(ids))
        for rid in freed:
            self.sched.released(rid)
        for rid in given_up:
            self.sched.released(rid)   # the stages' leases free it; the ledger cannot wait that long
            log.warning("release of %s failed %d times; the stages' lease will free it", rid,
                        self.releases.max_attempts)
        self.wake.set()                    # freed blocks may let waiting requests start

    async def _receive(self) -> None:
        async for reply in self.pipeline.replies():
            batch = self.frames.answered(reply.stream_seq)
            if batch is None:
                log.warning("reply to unknown or expired frame %d ignored", reply.stream_seq)
                continue
            if batch:                  # an empty batch is a keep-alive, never counted as in flight
                self.sched.frame_done()
            by_id: dict[str, stage_pb2.SlotResult] = {}
            for res in reply.results:
                by_id.setdefault(res.stamp.request_id, res)   # a duplicate result never overrides the first
            try:
                for req in batch:
                    self._settle(req, by_id.get(req.id))
            finally:
                # The feed loop first, then the tokens' delivery: the loop wakes in the order things were
                # scheduled, and the next frame is the critical path (the stages wait for it), where the tokens'
                # way to the callers (the Session writer, admission, the client) can run beside the next step.
                self.wake.set()
                delivered, self.delivered = self.delivered, []
                for q, out in delivered:
                    q.put_nowait(out)

    def _settle(self, req: Request, res: stage_pb2.SlotResult | None) -> None:
        """Apply one slot's result: append the token only if the echo is exactly what was sent."""
        if self._frame_over(req):   # ended while in flight: released, the result is of no use
            return
        j = judge(req, res, self._echo_ok, self._token_ok)
        if j.verdict is Verdict.REBUILD:
            self._rebuild(req, j.reason, j.detail)
        elif j.verdict is Verdict.PREFIX_MISS:
            self._prefix_miss(req, j.detail)
        elif j.verdict is Verdict.CONFIRM:
            self.sched.confirmed(req)
        else:
            assert res is not None   # judge appends only a result that came
            self._append(req, res.token_id)

    def _append(self, req: Request, token_id: int) -> None:
        """A proven token: the request's context grows by it, and its client hears of it."""
        self.sched.confirmed(req)
        out: TokenOut = req.seq.append(token_id)
        self.counters.tokens += 1
        q = self.sinks.get(req.id)
        if q is not None:
            self.delivered.append((q, out))   # put once the feed loop is woken (`_receive`)
        if self.traces:
            spans = self.traces.get(req.id)
            if spans is not None:
                if spans.phase_name != "decode":   # the first token (or the first after a rebuild)
                    spans.next_phase("decode")
                if out.finish_reason:
                    spans.finished(out.finish_reason)
        if out.finish_reason:
            self.counters.finished += 1
            if req.recoveries:
                self.counters.recovered += 1
            self._finish(req, None)

    @staticmethod
    def _echo_matches(req: Request, res: stage_pb2.SlotResult) -> bool:
        return req.echo_matches(res.stamp)

    def _token_hash_matches(self, req: Request, res: stage_pb2.SlotResult) -> bool:
        return res.token_hash == self._token_mac(req, res.token_id)

    def _token_mac(self, req: Request, token_id: int) -> int:
        """The keyed token hash a last stage holding this epoch's stamp key returns for `token_id`."""
        sent = req.sent
        assert sent is not None   # a frame is in flight
        return self.pipeline.stamp_key.token_mac(req.seq.hasher.peek([token_id]), req.id, sent.epoch,
                                                 sent.position + len(sent.token_ids), req.sampling_digest, token_id)

    def _prefix_miss(self, req: Request, detail: str) -> None:
        """A stage could not confirm the cached prefix the ledger predicted: replay the request cold (not
        charged to its budget: a cold replay cannot miss again), and forget the mirrored cache, which is
        evidently out of step with the stages'."""
        self.counters.rejections["PREFIX_MISS"] += 1
        self.counters.prefix_misses += 1
        log.info("request %s: PREFIX_MISS (%s); replaying it cold", req.id, detail, extra=self._log_extra(req))
        if self.traces:
            self._trace_event(req, "prefix miss", "PREFIX_MISS", detail)
        self.sched.ledger.rebuild(req.id)
        self.sched.ledger.forget_cache()
        req.rebuild(charge=False)

    def _rebuild(self, req: Request, reason: str, detail: str) -> None:
        """Replay the request's whole context under a new epoch, within its budget; else fail it explicitly."""
        self.counters.rejections[reason] += 1
        log.info("request %s: %s (%s)", req.id, reason, detail, extra=self._log_extra(req))
        if self.traces:
            self._trace_event(req, "rejection", reason, detail)
        if req.recoveries >= self.max_rebuilds:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if reason == "NO_CAPACITY" else grpc.StatusCode.ABORTED
            self._finish(req, Failure(code, f"request state could not be verified after {req.retries} "
                                            f"rebuilds and {req.resumes} resumes; last: {reason}: {detail}"))
            return
        self.counters.rebuilds += 1
        self.sched.ledger.rebuild(req.id)
        req.rebuild()   # tokens already sent stay as they are: they are replayed as context
        if self.traces:
            self._trace_event(req, "rebuild", reason, detail)   # after req.rebuild(): the new epoch

    async def _resync(self, reqs: list[Request]) -> None:
        """Ask every stage what it holds; resume requests all stages agree on, rebuild the rest."""
        for r in reqs:
            if r.fed == 0 and not r.done:   # nothing confirmed yet: send it again; stamps catch any leftovers
                r.resynced()
                r.sent, r.cached = None, 0
        reqs = [r for r in reqs if r.fed > 0 and not r.done]
        if not reqs:
            self.wake.set()
            return
        if self.traces:
            for r in reqs:
                self._trace_event(r, "resync", "PIPELINE_BROKEN" if self.health.recovering else "FRAME_LOST",
                                  "asking every stage what it holds")
        held = await self.pipeline.sync([r.id for r in reqs])     # per stage: request id -> HeldState
        for req in reqs:
            if req.done:   # ended during the sync: already released (Request.end from SYNCING)
                continue
            req.resynced()
            states = [h.get(req.id) for h in held]
            if held_everywhere(req, states):
                req.sent = None
                if req.recoveries >= self.max_rebuilds:
                    self._finish(req, Failure(grpc.StatusCode.ABORTED, f"request lost frames {req.recoveries + 1} "
                                              f"times (budget {self.max_rebuilds}); last resume after a sync"))
                    continue
                req.resumes += 1
                self.counters.resumes += 1
                if self.traces:
                    self._trace_event(req, "resume", "STATE_HELD", f"every stage holds {req.fed} tokens at "
                                                                   f"epoch {req.epoch}: continuing from there")
            else:
                self._rebuild(req, "STATE_LOST", f"stages hold {describe_held(states)}; coordinator has "
                                                 f"{req.fed} tokens")
        self.wake.set()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.frame_timeout_s / 4))
            late = self.frames.expired(self.frame_timeout_s)
            lost: list[Request] = []
            for batch in late:
                if batch:
                    self.sched.frame_done()
                self.counters.rejections["FRAME_LOST"] += 1
                lost.extend(r for r in batch if not self._frame_over(r, lost=True))
            if lost:
                log.warning("%d frame(s) unanswered for %.1fs: syncing %d request(s)", len(late),
                            self.frame_timeout_s, len(lost))
                await self._resync(lost)
