"""A relay's stream to the next stage: opened with the first frame to forward, its frames numbered from 1,
each remembered until the next stage answers it, and every answer merged with this stage's own results for
the same frame and handed back up (docs/PROTOCOL.md "Frames")."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tether import settings
from tether.faults import FaultInjector, OutboundFaults
from tether.v1 import stage_pb2, stage_pb2_grpc


class Downstream:
    """`deliver` takes each merged reply (in the order the next stage answers); `fail` ends the upstream stream
    when the next stage fails. With a fault injector, forwarded frames pass through its OutboundFaults."""

    def __init__(self, channel: Callable[[], grpc.aio.Channel | None], address: Callable[[], str | None],
                 injector: FaultInjector | None,
                 deliver: Callable[[stage_pb2.FrameReply], Awaitable[None]],
                 fail: Callable[[grpc.StatusCode, str], Awaitable[None]]) -> None:
        self._channel, self._address = channel, address   # read when a stream opens: handshakes change them
        self._injector = injector
        self._deliver, self._fail = deliver, fail
        self.call: Any = None   # the Forward stream to the next stage, once opened
        self._reader: asyncio.Task | None = None
        self._seq = 0
        # downstream seq -> (upstream seq, own results); bounded: a frame the next stage never answers is
        # forgotten once RELAY_PENDING_MAX newer ones wait (the coordinator times it out on its own)
        self.pending: OrderedDict[int, tuple[int, list]] = OrderedDict()
        self._write_lock = asyncio.Lock()             # the relay and a reorder flush both write
        self._faulty: OutboundFaults | None = None

    async def send(self, up_seq: int, own: list[stage_pb2.SlotResult], frame: stage_pb2.Frame) -> None:
        """Forward `frame` (the answer to upstream frame `up_seq`, with this stage's own results `own`)."""
        if self.call is None:
            channel = self._channel()
            if channel is None:
                raise RuntimeError("no next stage configured")
            self.call = stage_pb2_grpc.StageStub(channel).Forward()
            self._reader = asyncio.create_task(self._read(self.call))
        self._seq += 1
        frame.stream_seq = self._seq   # before any fault: a duplicate or reorder shows in the seq
        self.pending[self._seq] = (up_seq, own)
        while len(self.pending) > settings.RELAY_PENDING_MAX:
            self.pending.popitem(last=False)
        if self._injector is None:
            await self._write(frame)
            return
        if self._faulty is None:
            self._faulty = OutboundFaults(self._injector, self._write)
        await self._faulty.send(frame)

    async def _write(self, frame: stage_pb2.Frame) -> None:
        async with self._write_lock:
            await self.call.write(frame)

    async def _read(self, call) -> None:
        try:
            async for reply in call:
                entry = self.pending.pop(reply.stream_seq, None)
                if entry is None:
                    continue  # a reply to nothing we sent: drop it, the coordinator times the frame out
                up_seq, own = entry
                await self._deliver(stage_pb2.FrameReply(stream_seq=up_seq, results=[*own, *reply.results]))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not self.pending and call is self.call:
                # The next stage closed our stream for idleness while nothing was in flight: not a failure,
                # open a fresh one (from stream_seq 1) when the next frame comes.
                self.call, self._reader, self._seq = None, None, 0
                return
            await self._fail(grpc.StatusCode.UNAVAILABLE,
                             f"next stage {self._address()} failed: {e.code().name} {e.details()}")

    async def finish(self) -> None:
        """The upstream stream ended: flush what the injector holds, end ours, and wait for its last replies."""
        if self.call is None:
            return
        if self._faulty is not None:
            await self._faulty.drain()
        await self.call.done_writing()
        if self._reader is not None:
            await self._reader

    def close(self) -> None:
        if self._faulty is not None:
            self._faulty.close()
        if self._reader is not None:
            self._reader.cancel()
        if self.call is not None:
            self.call.cancel()
