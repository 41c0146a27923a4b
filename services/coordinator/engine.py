"""The engine loop: feeds micro-batches into the pipeline, checks every echoed stamp, appends tokens,
and fails requests explicitly when the pipeline breaks. One engine per pipeline, one asyncio task each."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from services.coordinator.pipeline import Pipeline, PipelineDown
from services.coordinator.scheduler import Request, Scheduler
from tether import settings
from tether.engine.sequence import TokenOut
from tether.v1 import stage_pb2

log = logging.getLogger(__name__)
R = stage_pb2.RejectReason
MAX_RETRIES = 3   # rebuilds of one request's state after rejected frames before it fails


@dataclass
class Failure:
    code: grpc.StatusCode
    message: str


@dataclass
class Counters:
    tokens: int = 0
    finished: int = 0
    failed: int = 0
    rejected_slots: int = 0
    rebuilds: int = 0


class Engine:
    def __init__(self, pipeline: Pipeline, hash_seed_for, max_slots: int = settings.MAX_BATCH_SLOTS,
                 max_tokens: int = settings.MAX_BATCH_TOKENS, frame_timeout_s: float = settings.FRAME_TIMEOUT_S):
        self.pipeline = pipeline
        self.hash_seed_for = hash_seed_for          # tenant -> chain salt
        self.sched = Scheduler(pipeline.num_stages, max_slots, max_tokens)
        self.frame_timeout_s = frame_timeout_s
        self.sinks: dict[str, asyncio.Queue] = {}   # request id -> events (TokenOut | Failure)
        self.frames: dict[int, tuple[float, list[Request]]] = {}   # seq -> (sent at, requests)
        self.to_release: list[str] = []
        self.wake = asyncio.Event()
        self.serving = False
        self.status = "connecting"
        self.counters = Counters()

    # --- requests ---------------------------------------------------------------------------------------
    def submit(self, req: Request) -> asyncio.Queue:
        if not self.serving:
            raise PipelineDown(f"pipeline not serving: {self.status}")
        q: asyncio.Queue = asyncio.Queue()
        self.sinks[req.id] = q
        self.sched.add(req)
        self.wake.set()
        return q

    def cancel(self, request_id: str) -> bool:
        """Stop a request (client gone or Cancel); its state is released once no frame of it is in flight."""
        req = self.sched.running.get(request_id) or next((r for r in self.sched.waiting if r.id == request_id), None)
        if req is None:
            return False
        self._finish(req, None)
        return True

    def _finish(self, req: Request, failure: Failure | None) -> None:
        started = req.id in self.sched.running
        self.sched.remove(req)
        q = self.sinks.pop(req.id, None)
        if failure is not None:
            self.counters.failed += 1
            if q is not None:
                q.put_nowait(failure)
        if started and not req.in_flight:
            self.to_release.append(req.id)
        self.wake.set()

    # --- the loop ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self.pipeline.connect()
            except PipelineDown as e:
                self._down(str(e))
                await asyncio.sleep(settings.RECONNECT_INTERVAL_S)
                continue
            self.serving, self.status = True, "serving"
            log.info("pipeline serving: %s", ", ".join(
                f"{s.address}[{s.layer_start},{s.layer_end})" for s in self.pipeline.stages))
            try:
                async with asyncio.TaskGroup() as tg:   # one failing task cancels the others
                    tg.create_task(self._feed())
                    tg.create_task(self._receive())
                    tg.create_task(self._watchdog())
            except* PipelineDown as eg:
                self._down(str(eg.exceptions[0]))
            self.pipeline.close_stream()
            await asyncio.sleep(settings.RECONNECT_INTERVAL_S)

    def _down(self, why: str) -> None:
        """Fail everything in flight or queued with UNAVAILABLE: recovery of in-flight state is not promised."""
        if self.serving or self.status != why:
            log.warning("pipeline down: %s", why)
        self.serving, self.status = False, why
        for req in [*self.sched.running.values(), *self.sched.waiting]:
            req.in_flight = False
            self._finish(req, Failure(grpc.StatusCode.UNAVAILABLE, f"pipeline failed during generation: {why}"))
        self.frames.clear()
        self.sched.frames_in_flight = 0

    async def _feed(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if self.to_release:
                ids, self.to_release = self.to_release, []
                asyncio.create_task(self.pipeline.release(ids))
            while batch := self.sched.next_batch():
                slots = [stage_pb2.Slot(stamp=r.sent, sampling=r.seq.sampling, sample=True,
                                        hash_seed=r.seq.hash_seed) for r in batch]
                seq = await self.pipeline.send(slots)
                self.frames[seq] = (time.monotonic(), batch)

    async def _receive(self) -> None:
        async for reply in self.pipeline.replies():
            entry = self.frames.pop(reply.stream_seq, None)
            if entry is None:
                log.warning("reply to unknown frame %d ignored", reply.stream_seq)
                continue
            self.sched.frame_done()
            _, batch = entry
            by_id = {}
            for res in reply.results:
                by_id.setdefault(res.stamp.request_id, res)
            for req in batch:
                self._settle(req, by_id.get(req.id))
            self.wake.set()

    def _settle(self, req: Request, res: stage_pb2.SlotResult | None) -> None:
        """Apply one slot's result: append the token only if the echo is exactly what was sent."""
        if req.done:   # cancelled while in flight
            req.in_flight = False
            self.to_release.append(req.id)
            return
        if res is None or not req.echo_matches(res.stamp) or (res.ok and not res.has_token):
            why = "no result" if res is None else "echo does not match the stamp sent" if res.ok else ""
            self._reject(req, R.BAD_FRAME if res is None or res.ok else res.reason, why or res.detail,
                         -1 if res is None else res.stage_index)
            return
        if not res.ok:
            self._reject(req, res.reason, res.detail, res.stage_index)
            return
        req.confirm()
        out: TokenOut = req.seq.append(res.token_id)
        self.counters.tokens += 1
        q = self.sinks.get(req.id)
        if q is not None:
            q.put_nowait(out)
        if out.finish_reason:
            self.counters.finished += 1
            self._finish(req, None)

    def _reject(self, req: Request, reason: int, detail: str, stage: int) -> None:
        self.counters.rejected_slots += 1
        name = stage_pb2.RejectReason.Name(reason)
        log.warning("request %s rejected at stage %d: %s %s", req.id, stage, name, detail)
        if req.retries >= MAX_RETRIES:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if reason == R.NO_CAPACITY else grpc.StatusCode.ABORTED
            req.in_flight = False
            self._finish(req, Failure(code, f"request state could not be verified after {req.retries} rebuilds: "
                                            f"stage {stage} rejected it ({name}: {detail})"))
            return
        self.counters.rebuilds += 1
        req.rebuild()   # replay the whole context under a new epoch; tokens already sent stay as they are

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            late = [seq for seq, (t, _) in self.frames.items() if now - t > self.frame_timeout_s]
            if late:
                raise PipelineDown(f"frame {late[0]} unanswered for {self.frame_timeout_s:.0f}s")
