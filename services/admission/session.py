"""Admission's client of a coordinator: every request to one pipeline over one `Session` stream (docs/PROTOCOL.md
"Session"), its submits and cancels batched per message, each TokenEvent handed to its request's queue."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from typing import Any

import grpc

from tether.v1 import coordinator_pb2, coordinator_pb2_grpc

_SESSION_BATCH_BYTES = 256 * 1024   # submits per SessionMessage: one prompt alone is far under the 1 MiB limit
# How a Session stream ends when its transport fails (the coordinator died, its connection reset): gRPC core says
# UNAVAILABLE, or INTERNAL ("Internal error from Core") or UNKNOWN depending on when the reset lands. The coordinator
# never ends the stream with either itself (a request's failure comes as its own event), so each request on the
# stream was dropped, not failed: UNAVAILABLE, which admission continues elsewhere and a caller may retry, rather
# than "admission hit an internal error" (seen killing a coordinator under a storm of requests). An interceptor's
# refusal (PERMISSION_DENIED, UNAUTHENTICATED) keeps its code.
_TRANSPORT_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


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
            if code in _TRANSPORT_CODES:
                code, details = grpc.StatusCode.UNAVAILABLE, f"the session stream broke ({code.name}: {details})"
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
        stream, q = self.stream, asyncio.Queue[Any]()
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
