"""One upstream Forward stream through a stage: frames checked for order and pipeline epoch, run on the step
thread one at a time, answered here or forwarded to the next stage (services/stage_worker/downstream.py), and
replies queued back up; the stream ends with a status when anything fails, or when it idles."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from services.stage_worker.downstream import Downstream
from services.stage_worker.state import FrameView
from services.stage_worker.worker import StepOutcome
from tether.v1 import stage_pb2

if TYPE_CHECKING:
    from services.stage_worker.server import StageServicer

log = logging.getLogger(__name__)
DONE = object()     # queued after the last reply: the handler returns and the stream ends OK
OUT_BUFFER = 64     # replies queued per stream before the stream stops reading frames (backpressure)


class IdleClock:
    """When the stream last saw a frame in or a reply out."""

    def __init__(self) -> None:
        self.last = asyncio.get_running_loop().time()

    def touch(self) -> None:
        self.last = asyncio.get_running_loop().time()

    async def expire(self, idle_s: float) -> None:
        """Return once nothing has happened for `idle_s`."""
        loop = asyncio.get_running_loop()
        while (left := self.last + idle_s - loop.time()) > 0:
            await asyncio.sleep(left)


class Relay:
    def __init__(self, svc: StageServicer, context, handler: asyncio.Task) -> None:
        self.svc = svc
        self.context = context
        self.handler = handler          # the Forward handler's task (cancelled when the stream fails)
        self.out: asyncio.Queue = asyncio.Queue(maxsize=OUT_BUFFER)
        self.last_seq = 0               # the highest stream_seq seen (BAD_SEQUENCE below the next one)
        self.failed = False
        self.idle = IdleClock()
        self.down = Downstream(lambda: svc.next_channel, lambda: svc.next_address,
                               svc.faults.injector if svc.faults is not None else None, self.out.put, self.fail)

    def touch(self) -> None:
        self.idle.touch()

    async def fail(self, code: grpc.StatusCode, details: str) -> None:
        """End the upstream stream with a status, from whichever task noticed; the handler is cancelled so it
        stops waiting (it may be blocked on a client that no longer reads)."""
        if self.failed:
            return
        self.failed = True
        try:
            await self.context.abort(code, details)
        except Exception:   # abort() raises to unwind its caller; here the caller is not the handler
            pass
        self.handler.cancel()

    async def watch_idle(self) -> None:
        """Close the stream once nothing has come in or gone out for stream_idle_s (a client that opened a
        stream and went quiet must not hold a stream slot and its relay forever)."""
        idle_s = self.svc.stream_idle_s
        await self.idle.expire(idle_s)
        await self.fail(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"{self.svc.who}: Forward stream idle for {idle_s:g} s (no frame in, no reply out): closed")

    async def pump(self, request_iterator) -> None:
        loop = asyncio.get_running_loop()
        faults = self.svc.faults
        try:
            async for frame in request_iterator:
                self.touch()
                if faults is not None:
                    faults.on_arrival()
                outcome = self._frame_checks(frame)
                if outcome is None:
                    forget = faults.forget(frame) if faults is not None else None
                    outcome = await loop.run_in_executor(self.svc.executor, self.svc.step, frame, forget)
                await self._route(frame.stream_seq, outcome)
            await self.down.finish()
            await self.out.put(DONE)
        except asyncio.CancelledError:
            raise
        except DecodeError as e:   # grpc.aio hands the handler the parse error of an undecodable message
            await self.fail(grpc.StatusCode.INVALID_ARGUMENT, f"{self.svc.who}: malformed Frame: {e}")
        except grpc.aio.AioRpcError as e:
            await self.fail(grpc.StatusCode.UNAVAILABLE,
                            f"next stage {self.svc.next_address} failed: {e.code().name} {e.details()}")
        except Exception as e:  # a bug or a torch error: fail the stream loudly rather than answer wrongly
            if self.failed:
                return   # the stream was already ended (idle, downstream): its read or write fails now
            log.exception("stage step failed")
            await self.fail(grpc.StatusCode.UNAVAILABLE, f"stage {self.svc.worker.index} failed: {e}")

    def _frame_checks(self, frame) -> StepOutcome | None:
        """The `stream` rows of the stage's checks (state.CHECKS: BAD_SEQUENCE, STALE_EPOCH)."""
        view = FrameView(frame, last_seq=self.last_seq, pipeline_epoch=self.svc.pipeline_epoch)
        self.last_seq = max(self.last_seq, frame.stream_seq)
        return self.svc.worker.refused("stream", view)

    async def _route(self, up_seq: int, outcome: StepOutcome) -> None:
        if outcome.forward is not None:
            await self.down.send(up_seq, outcome.results, outcome.forward)
            return
        reply = stage_pb2.FrameReply(stream_seq=up_seq, results=outcome.results)
        await self.out.put(self.svc.faults.reply(reply) if self.svc.faults is not None else reply)

    async def close(self) -> None:
        self.down.close()
