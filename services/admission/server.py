"""Admission's gRPC face: the Admission service's RPCs as a thin translation over the front door (door.py).

A call becomes a `Call` (its metadata and deadline), its request goes through `FrontDoor.handle`, its events
become GenerateResponse / GenerateChunk messages, and a `Rejected` becomes the call's status (with RetryInfo
in grpc-status-details-bin when waiting helps). What admission decides lives in door.py, not here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc

from services.admission.door import FrontDoor
from services.admission.outcome import Call
from services.admission.pipelines import Routed, watch_readiness
from services.admission.status import Rejected
from services.admission.tagger import Tags
from tether.grpcutil import Server
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

_SERVICE = "tether.v1.Admission"


def tags_proto(tags: Tags, routed: Routed | None = None) -> common_pb2.IntentTags:
    proto = common_pb2.IntentTags(**dataclasses.asdict(tags))
    if routed is not None:
        proto.pipeline, proto.route_reason = routed.link.name, routed.reason   # a name, never an address
    return proto


def grpc_call(method: str, context: grpc.aio.ServicerContext) -> Call:
    remaining = context.time_remaining()
    return Call(method, context.invocation_metadata() or (),
                None if remaining is None else time.monotonic() + remaining,
                {"rpc.system": "grpc", "rpc.service": _SERVICE, "rpc.method": method})


@asynccontextmanager
async def as_status(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """A `Rejected` out of the body becomes the call's status (grpc.aio's abort raises, ending the handler)."""
    try:
        yield
    except Rejected as e:
        await context.abort(e.code, e.message, e.trailers())


class AdmissionServicer(admission_pb2_grpc.AdmissionServicer):
    """Generate, GenerateStream and Tag, each request routed to one of the pipelines (a Session stream each)."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door

    async def Generate(self, request: admission_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> admission_pb2.GenerateResponse:
        async with as_status(context), self.door.handle(grpc_call("Generate", context), request) as (a, routed, events):
            response = admission_pb2.GenerateResponse(tags=tags_proto(a.tags, routed), seed=a.valid.sampling.seed)
            text: list[str] = []
            async for event, receipt in events:
                response.token_ids.append(event.token_id)
                text.append(event.text)
                if receipt is not None:
                    response.finish_reason = event.finish_reason
                    response.receipt.CopyFrom(receipt)
        response.text = "".join(text)
        return response

    async def GenerateStream(self, request: admission_pb2.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[admission_pb2.GenerateChunk]:
        call = grpc_call("GenerateStream", context)
        async with as_status(context), self.door.handle(call, request) as (a, routed, events):
            async for event, receipt in events:
                chunk = admission_pb2.GenerateChunk(index=event.index, token_id=event.token_id,
                                                    text=event.text, finish_reason=event.finish_reason)
                if event.index == len(a.valid.resume_token_ids):   # this call's first chunk (0 unless resumed)
                    chunk.tags.CopyFrom(tags_proto(a.tags, routed))
                    chunk.seed = a.valid.sampling.seed
                    chunk.internal_id = a.internal_id
                if receipt is not None:
                    chunk.receipt.CopyFrom(receipt)
                yield chunk

    async def Tag(self, request: admission_pb2.TagRequest,
                  context: grpc.aio.ServicerContext) -> admission_pb2.TagResponse:
        as_generate = admission_pb2.GenerateRequest(prompt=request.prompt, sampling=request.sampling,
                                                    tenant=request.tenant, priority=request.priority,
                                                    messages=request.messages)
        async with as_status(context):
            tags = await self.door.tag(grpc_call("Tag", context), as_generate)
        return admission_pb2.TagResponse(tags=tags_proto(tags))


async def follow_readiness(server: Server, door: FrontDoor) -> None:
    """Report SERVING only while some pipeline serves our model (from their load reports; supervised)."""
    async def changed(ready: bool, why: str) -> None:
        door.set_ready(ready, why)
        await server.set_serving(ready)
        log.log(logging.INFO if ready else logging.WARNING, "admission %s (%s)",
                "SERVING" if ready else "NOT_SERVING", why)

    await watch_readiness(door.pipelines, changed)
