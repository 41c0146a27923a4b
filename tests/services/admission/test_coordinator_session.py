"""Admission's Session client (services/admission/session.py) against a coordinator on loopback whose Session
stream ends with a given status after the first submit: what each request's queue is told."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.admission.session import CoordinatorSession, SessionBroken
from tether.v1 import coordinator_pb2, coordinator_pb2_grpc


class _Ending(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def Session(self, request_iterator, context):
        async for _ in request_iterator:
            await context.abort(self.code, "the stream ends here")


async def _broken(code: grpc.StatusCode) -> SessionBroken:
    server = grpc.aio.server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(_Ending(code), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            session = CoordinatorSession(coordinator_pb2_grpc.CoordinatorStub(channel))
            events = session.start(coordinator_pb2.SubmitRequest(request_id="r1", prompt_token_ids=[1, 2, 3]))
            event = await asyncio.wait_for(events.get(), timeout=30)
            assert isinstance(event, SessionBroken), event
            return event
    finally:
        await server.stop(None)


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
def test_a_stream_broken_by_its_transport_drops_its_requests_as_unavailable(code):
    """gRPC core ends a stream whose connection resets with INTERNAL or UNKNOWN at times: the requests were
    dropped, not failed, so admission continues them elsewhere and a caller may retry (UNAVAILABLE)."""
    broken = asyncio.run(_broken(code))
    assert broken.code == grpc.StatusCode.UNAVAILABLE
    assert code.name in broken.details and "the stream ends here" in broken.details


@pytest.mark.parametrize("code", [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE])
def test_a_refusal_keeps_its_code(code):
    broken = asyncio.run(_broken(code))
    assert broken.code == code and broken.details == "the stream ends here"
