"""The Stage gRPC service: handshake down the chain, Forward with relay, SyncState, Release, leases.

Each upstream Forward stream gets its own downstream stream to the next stage; replies from downstream are
merged with this stage's own rejections and relayed upstream, so results reach the coordinator on the
stream it opened. A broken downstream aborts the upstream stream with UNAVAILABLE: nothing hangs.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.stage_worker.worker import StageWorker, StepOutcome
from tether import grpcutil, settings
from tether.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)
R = stage_pb2.RejectReason
_DONE = object()


class StageServicer(stage_pb2_grpc.StageServicer):
    def __init__(self, worker: StageWorker, fingerprint: str, address: str, kv_capacity: int,
                 lease_s: float = settings.KV_LEASE_S) -> None:
        self.worker = worker
        self.model = worker.model
        self.fingerprint = fingerprint
        self.address = address
        self.kv_capacity = kv_capacity
        self.lease_s = lease_s
        self.pipeline_epoch: int | None = None
        self.next_address: str | None = None
        self.next_channel: grpc.aio.Channel | None = None
        # One thread: the model and KV state are touched by one step at a time, in frame order.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-step")

    # --- handshake ------------------------------------------------------------------------------------
    def info(self) -> stage_pb2.StageInfo:
        m = self.model
        return stage_pb2.StageInfo(
            address=self.address, layer_start=m.layer_start, layer_end=m.layer_end, has_embedding=m.has_embedding,
            has_head=m.has_head, model_fingerprint=self.fingerprint, protocol_version=settings.PROTOCOL_VERSION,
            kv_capacity_tokens=self.kv_capacity, num_layers=m.cfg.num_hidden_layers, dtype=self.worker.dtype)

    def _refusal(self, req: stage_pb2.HandshakeRequest) -> str | None:
        m = self.model
        who = f"stage {req.index} ({self.address})"
        if req.protocol_version != settings.PROTOCOL_VERSION:
            return f"{who} speaks protocol v{settings.PROTOCOL_VERSION}, coordinator v{req.protocol_version}"
        if req.model_fingerprint != self.fingerprint:
            return f"{who} loaded model {self.fingerprint}, coordinator expects {req.model_fingerprint}"
        if req.dtype and req.dtype != self.worker.dtype:
            return f"{who} runs {self.worker.dtype}, coordinator expects {req.dtype}"
        if req.index >= len(req.route):
            return f"{who} is not in the route"
        if m.layer_start != req.prev_layer_end:
            kind = "gap" if m.layer_start > req.prev_layer_end else "overlap"
            return (f"{who} holds layers [{m.layer_start}, {m.layer_end}) but the previous stage ends at "
                    f"{req.prev_layer_end}: a {kind} in the layer ranges")
        last = req.index == len(req.route) - 1
        if last and not m.has_head:
            return (f"{who} is the last stage but holds layers [{m.layer_start}, {m.layer_end}) of "
                    f"{m.cfg.num_hidden_layers}: the route lacks the head")
        if not last and m.has_head:
            return f"{who} holds the head but {len(req.route) - 1 - req.index} stage(s) follow it"
        return None

    async def Handshake(self, request, context):
        refusal = self._refusal(request)
        if refusal:
            log.warning("handshake refused: %s", refusal)
            return stage_pb2.HandshakeReply(ok=False, error=refusal, stages=[self.info()])
        stages = [self.info()]
        if request.index + 1 < len(request.route):
            nxt = request.route[request.index + 1].address
            if nxt != self.next_address:
                if self.next_channel is not None:
                    await self.next_channel.close()
                self.next_channel, self.next_address = grpcutil.channel(nxt), nxt
            down = stage_pb2.HandshakeRequest()
            down.CopyFrom(request)
            down.index = request.index + 1
            down.prev_layer_end = self.model.layer_end
            try:
                reply = await stage_pb2_grpc.StageStub(self.next_channel).Handshake(down, timeout=10)
            except grpc.aio.AioRpcError as e:
                # Not a refusal: the route may assemble once that stage is up, so the caller retries.
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"stage {down.index} ({nxt}) unreachable from stage {request.index}: {e.details()}")
            stages.extend(reply.stages)
            if not reply.ok:
                return stage_pb2.HandshakeReply(ok=False, error=reply.error, stages=stages)
        self.pipeline_epoch = request.pipeline_epoch
        self.worker.index = request.index
        log.info("handshake ok: stage %d of %d, layers [%d, %d), pipeline epoch %x", request.index,
                 len(request.route), self.model.layer_start, self.model.layer_end, request.pipeline_epoch)
        return stage_pb2.HandshakeReply(ok=True, stages=stages)

    # --- forward --------------------------------------------------------------------------------------
    async def Forward(self, request_iterator, context):
        if self.pipeline_epoch is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no handshake yet: stage is not part of a pipeline")
        out: asyncio.Queue = asyncio.Queue()
        relay = _Relay(self, out)
        pump = asyncio.create_task(relay.pump(request_iterator))
        try:
            while True:
                item = await out.get()
                if item is _DONE:
                    return
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                yield item
        finally:
            pump.cancel()
            await relay.close()

    async def SyncState(self, request, context):
        return stage_pb2.SyncReply(states=[self.worker.state.held(r) for r in request.request_ids])

    async def Release(self, request, context):
        n = await asyncio.get_running_loop().run_in_executor(
            self.executor, self.worker.state.release, list(request.request_ids))
        return stage_pb2.ReleaseReply(released=n)

    async def expire_leases(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.lease_s / 10))
            stale = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.worker.state.expire, self.lease_s)
            if stale:
                log.info("lease expired: freed %d idle request(s)", len(stale))


class _Relay:
    """One upstream stream: check and run frames in order, forward downstream, merge replies back up."""

    def __init__(self, svc: StageServicer, out: asyncio.Queue) -> None:
        self.svc = svc
        self.out = out
        self.last_seq = 0
        self.down_seq = 0
        self.pending: dict[int, tuple[int, list]] = {}   # downstream seq -> (upstream seq, own results)
        self.down_call = None
        self.down_reader: asyncio.Task | None = None

    async def pump(self, request_iterator) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for frame in request_iterator:
                outcome = self._frame_checks(frame)
                if outcome is None:
                    outcome = await loop.run_in_executor(self.svc.executor, self.svc.worker.process, frame)
                await self._route(frame.stream_seq, outcome)
            if self.down_call is not None:
                await self.down_call.done_writing()
                await self.down_reader
            await self.out.put(_DONE)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            await self.out.put(ConnectionError(f"next stage {self.svc.next_address} failed: {e.code().name} {e.details()}"))
        except Exception as e:  # a bug or a torch error: fail the stream loudly rather than answer wrongly
            log.exception("stage step failed")
            await self.out.put(RuntimeError(f"stage {self.svc.worker.index} failed: {e}"))

    def _frame_checks(self, frame) -> StepOutcome | None:
        """Frame-level checks of the stream (sequence, pipeline epoch)."""
        w = self.svc.worker
        seq_ok = frame.stream_seq == self.last_seq + 1
        self.last_seq = max(self.last_seq, frame.stream_seq)
        if not seq_ok:
            return w.reject_all(frame, R.BAD_SEQUENCE, f"stream_seq {frame.stream_seq} is not the next one")
        if frame.pipeline_epoch != self.svc.pipeline_epoch:
            return w.reject_all(frame, R.STALE_EPOCH, "frame of another pipeline epoch")
        return None

    async def _route(self, seq: int, outcome: StepOutcome) -> None:
        if outcome.forward is None:
            await self.out.put(stage_pb2.FrameReply(stream_seq=seq, results=outcome.results))
            return
        if self.down_call is None:
            if self.svc.next_channel is None:
                raise RuntimeError("no next stage configured")
            self.down_call = stage_pb2_grpc.StageStub(self.svc.next_channel).Forward()
            self.down_reader = asyncio.create_task(self._read_down())
        self.down_seq += 1
        outcome.forward.stream_seq = self.down_seq
        self.pending[self.down_seq] = (seq, outcome.results)
        await self.down_call.write(outcome.forward)

    async def _read_down(self) -> None:
        try:
            async for reply in self.down_call:
                up_seq, own = self.pending.pop(reply.stream_seq, (None, None))
                if up_seq is None:
                    continue  # a reply to nothing we sent: drop it, the coordinator times the frame out
                await self.out.put(stage_pb2.FrameReply(stream_seq=up_seq, results=[*own, *reply.results]))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            await self.out.put(ConnectionError(f"next stage {self.svc.next_address} failed: {e.code().name} {e.details()}"))

    async def close(self) -> None:
        if self.down_reader is not None:
            self.down_reader.cancel()
        if self.down_call is not None:
            self.down_call.cancel()
