"""The coordinator's connection to its route of stage workers: handshake, the Forward stream, Release."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import grpc

from tether import grpcutil, settings
from tether.faults import FaultInjector, OutboundFaults, crash
from tether.security import identity, server_check
from tether.security.tls import TlsConfig
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)


class PipelineDown(Exception):
    """The pipeline cannot carry frames: refused handshake, unreachable stage, broken stream."""


class Pipeline:
    def __init__(self, addresses: list[str], fingerprint: str, dtype: str,
                 faults: FaultInjector | None = None, tls: TlsConfig | None = None) -> None:
        if not addresses:
            raise ValueError("a pipeline needs at least one stage address")
        self.addresses = addresses
        self.fingerprint = fingerprint
        self.dtype = dtype   # what the stages must run; "" (--dtype auto): what they chose, stage 0 first
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"a stage address appears twice in the route {', '.join(addresses)}")
        # With TLS every call presents our certificate (the stages take handshakes and frames from it alone),
        # and the server at route position i must be spiffe://tether.local/stage/i: anyone else holding a
        # certificate of the CA is refused before it is sent a byte (no stamp key, no prompt).
        self.tls = tls
        self.channels = {a: grpcutil.channel(a, tls=tls, expect=identity.stage(i)) for i, a in enumerate(addresses)}
        self.epoch = 0
        self.stamp_key = StampKey.generate()   # replaced at every handshake; only stages of that handshake know it
        self.stages: list[stage_pb2.StageInfo] = []
        self.call: Any = None   # the Forward stream of the handshaken route
        self.stream_seq = 0
        self.faults = faults or FaultInjector()    # off unless configured: the chaos experiments' hook
        # Stages free what an earlier coordinator process left behind when they see a new instance.
        self.instance = secrets.token_hex(8)
        self.outbound = OutboundFaults(self.faults, self._write)
        self.stubs = {a: stage_pb2_grpc.StageStub(ch) for a, ch in self.channels.items()}
        # Releases asked for while one is in flight go out together in the next (see `release`).
        self._release_next: tuple[list[str], asyncio.Future] | None = None
        self._release_task: asyncio.Task | None = None

    @property
    def served_dtype(self) -> str:
        """What the handshaken stages run (all the same: they refuse a mix); "" before a handshake."""
        return self.stages[0].dtype if self.stages else self.dtype

    @property
    def served_kernels(self) -> str:
        """The handshaken stages' kernels (all the same: they refuse a mix); "" before a handshake."""
        return self.stages[0].kernels if self.stages else ""

    @property
    def num_stages(self) -> int:
        return len(self.addresses)

    def frame_limits(self) -> tuple[int, int]:
        """(slots, rows) per frame that every stage of the handshaken route accepts (0 = no stage said)."""
        slots = [s.max_frame_slots for s in self.stages if s.max_frame_slots]
        rows = [s.max_frame_rows for s in self.stages if s.max_frame_rows]
        return (min(slots) if slots else 0), (min(rows) if rows else 0)

    async def connect(self) -> None:
        """Handshake down the chain under a fresh pipeline epoch, then open the Forward stream."""
        epoch = secrets.randbits(63) or 1
        key = StampKey.generate()   # a fresh secret per pipeline epoch: stamps of an older one are worthless
        req = stage_pb2.HandshakeRequest(
            protocol_version=settings.PROTOCOL_VERSION, model_fingerprint=self.fingerprint,
            route=[stage_pb2.RouteEntry(address=a) for a in self.addresses], index=0, prev_layer_end=0,
            pipeline_epoch=epoch, dtype=self.dtype, coordinator_instance=self.instance, stamp_key=key.key)
        stub = stage_pb2_grpc.StageStub(self.channels[self.addresses[0]])
        try:
            reply = await stub.Handshake(req, timeout=15)
        except grpc.aio.AioRpcError as e:
            if "unreachable from stage" in (e.details() or ""):
                raise PipelineDown(f"pipeline not assembled: {e.details()}") from None
            why = await server_check.refusal(self.addresses[0], self.tls, identity.stage(0))
            if why is not None:
                raise PipelineDown(f"refused the server at {self.addresses[0]} as stage 0: {why}; the pipeline "
                                   f"stays down until stage 0 itself serves there") from None
            raise PipelineDown(f"stage 0 ({self.addresses[0]}) unreachable: {e.code().name} {e.details()}") from None
        if not reply.ok:
            raise PipelineDown(f"pipeline refused: {reply.error}")
        blocks = sorted({s.kv_block_tokens for s in reply.stages})
        if len(blocks) != 1 or not blocks[0]:   # the scheduler's ledger mirrors every stage's pool in one unit
            raise PipelineDown(f"pipeline refused: its stages' KV blocks hold {blocks} positions; the coordinator "
                               f"schedules over one block size")
        self.epoch, self.stages, self.stream_seq, self.stamp_key = epoch, list(reply.stages), 0, key
        self.call = stub.Forward()

    def frame(self, slots: list[stage_pb2.Slot]) -> stage_pb2.Frame:
        """The stream's next frame, numbered, its stamps signed (before any fault injection: a faulted stamp
        must not be re-signed). Note its stream_seq before sending it: the reply may be read first."""
        self.stream_seq += 1
        self.stamp_key.sign(slots)
        return stage_pb2.Frame(stream_seq=self.stream_seq, pipeline_epoch=self.epoch, slots=slots,
                               payload_digest=self.stamp_key.frame_digest(b"", slots))

    async def send(self, frame: stage_pb2.Frame) -> None:
        if not self.faults.enabled:
            await self._write(frame)
            return
        if self.faults.crash():
            crash(log)
        await self.outbound.send(frame)

    async def _write(self, frame: stage_pb2.Frame) -> None:
        try:
            await self.call.write(frame)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError, AttributeError) as e:
            raise PipelineDown(f"Forward stream to stage 0 broke: {e!r}") from None

    async def replies(self):
        """FrameReplies in arrival order; raises PipelineDown when the stream breaks."""
        try:
            async for reply in self.call:
                yield reply
        except grpc.aio.AioRpcError as e:
            raise PipelineDown(f"pipeline stream failed: {e.code().name}: {e.details()}") from None
        raise PipelineDown("pipeline stream ended")

    async def sync(self, request_ids: list[str]) -> list[dict[str, stage_pb2.HeldState]]:
        """What every stage holds for these requests, in route order."""
        req = stage_pb2.SyncRequest(request_ids=request_ids)
        out = []
        for a in self.addresses:
            try:
                reply = await stage_pb2_grpc.StageStub(self.channels[a]).SyncState(req, timeout=10)
            except grpc.aio.AioRpcError as e:
                raise PipelineDown(f"SyncState on {a} failed: {e.code().name} {e.details()}") from None
            out.append({s.request_id: s for s in reply.states})
        return out

    def close_stream(self) -> None:
        self.outbound.close()     # frames held for reordering belong to the dead stream
        if self.call is not None:
            self.call.cancel()
            self.call = None

    async def release(self, request_ids: list[str]) -> set[str]:
        """Free these requests' KV on every stage; the ids that some stage could not be told about.

        One Release per stage at a time: ids asked for while one is in flight wait for it and go out together
        in the next. Under load that is one call per round trip instead of one per finished request (a unary
        call costs ~0.5 ms of CPU at each end), and nothing waits longer than the call in flight."""
        if self._release_next is None:
            self._release_next = ([], asyncio.get_running_loop().create_future())
        ids, done = self._release_next
        ids.extend(request_ids)
        if self._release_task is None or self._release_task.done():
            self._release_task = asyncio.create_task(self._flush_releases())
        failed = await asyncio.shield(done)   # a caller cancelled leaves the others' answer intact
        return failed.intersection(request_ids)

    async def _flush_releases(self) -> None:
        while self._release_next is not None:
            (ids, done), self._release_next = self._release_next, None
            try:
                failed = await self._release_now(ids)
            except Exception as e:   # noqa: BLE001 - every caller must get an answer
                log.info("release of %d request(s) failed: %r", len(ids), e)
                failed = set(ids)
            if not done.done():
                done.set_result(failed)

    async def _release_now(self, request_ids: list[str]) -> set[str]:
        req = stage_pb2.ReleaseRequest(request_ids=request_ids)
        calls = [stub.Release(req, timeout=5) for stub in self.stubs.values()]
        failed: set[str] = set()
        for address, res in zip(self.stubs, await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(res, Exception):
                log.info("release of %d request(s) on %s failed: %s", len(request_ids), address, res)
                failed.update(request_ids)
        return failed

    async def close(self) -> None:
        self.close_stream()
        for ch in self.channels.values():
            await ch.close()


def stages_widen(stages: list[stage_pb2.StageInfo]) -> bool:
    """Whether every handshaken stage runs a micro-batch alone in the pipeline on more threads than under load
    (StageInfo.alone_threads): only then is one micro-batch in flight worth the stages it leaves idle."""
    return bool(stages) and all(s.alone_threads > s.threads for s in stages)


def alone_limit(stages: list[stage_pb2.StageInfo], asked: int | None) -> int:
    """The most active requests the scheduler keeps one micro-batch in flight for: 0 unless every stage widens a
    micro-batch alone (`stages_widen`), else `asked`, or by default settings.ALONE_MAX_REQUESTS, or
    ALONE_MAX_REQUESTS_Q8 where every stage multiplies q8 inputs (StageInfo.linear_inputs)."""
    if not stages_widen(stages):
        return 0
    if asked is not None:
        return asked
    q8 = all(s.linear_inputs == "q8" for s in stages)
    return settings.ALONE_MAX_REQUESTS_Q8 if q8 else settings.ALONE_MAX_REQUESTS
