"""The Admission service: validate, tag, limit, forward to the coordinator, stream back with a receipt."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from services.admission.tagger import Tags, tag
from services.admission.validate import ModelLimits, ValidRequest, validate
from tether import settings
from tether.grpcutil import Server
from tether.protocol.hashing import prompt_digest
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

STATUS_DETAILS_KEY = "grpc-status-details-bin"


class ConcurrencyLimit:
    """A non-blocking cap: a request over it is refused at once, never queued (DESIGN.md: "never a hang")."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def try_acquire(self) -> bool:
        # No lock: the asyncio loop runs this check-and-increment without interleaving.
        if self.active >= self.limit:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1


def retry_status_details(code: grpc.StatusCode, message: str, retry_after_s: float) -> bytes:
    """A serialized google.rpc.Status with a RetryInfo detail (the value of grpc-status-details-bin)."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_after_s * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status_pb2.Status(code=code.value[0], message=message, details=[detail]).SerializeToString()


def tags_proto(tags: Tags) -> common_pb2.IntentTags:
    return common_pb2.IntentTags(**dataclasses.asdict(tags))


class AdmissionServicer(admission_pb2_grpc.AdmissionServicer):
    """Generate, GenerateStream and Tag, forwarding to one coordinator over a shared channel."""

    def __init__(self, coordinator: grpc.aio.Channel, coordinator_target: str, model: ModelLimits,
                 model_fingerprint: str, max_concurrent: int = settings.MAX_CONCURRENT_REQUESTS) -> None:
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(coordinator)
        self.coordinator_target = coordinator_target
        self.model = model
        self.model_fingerprint = model_fingerprint
        self.limit = ConcurrencyLimit(max_concurrent)

    # ---- RPCs -------------------------------------------------------------------------------------------

    async def Generate(self, request: admission_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> admission_pb2.GenerateResponse:
        valid, tags = await self._admit(request, context)
        response = admission_pb2.GenerateResponse(tags=tags_proto(tags), seed=valid.sampling.seed)
        text: list[str] = []
        await self._acquire(context)
        try:
            async with aclosing(self._generate(request, valid, tags, context)) as events:
                async for event, receipt in events:
                    response.token_ids.append(event.token_id)
                    text.append(event.text)
                    if receipt is not None:
                        response.finish_reason = event.finish_reason
                        response.receipt.CopyFrom(receipt)
        finally:
            self.limit.release()
        response.text = "".join(text)
        return response

    async def GenerateStream(self, request: admission_pb2.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[admission_pb2.GenerateChunk]:
        valid, tags = await self._admit(request, context)
        await self._acquire(context)
        try:
            # aclosing: when grpc.aio cancels this handler (disconnect, deadline) while it waits to send,
            # the inner generator must close now, cancelling the coordinator call, not whenever it is collected.
            async with aclosing(self._generate(request, valid, tags, context)) as events:
                async for event, receipt in events:
                    chunk = admission_pb2.GenerateChunk(index=event.index, token_id=event.token_id,
                                                        text=event.text, finish_reason=event.finish_reason)
                    if event.index == 0:
                        chunk.tags.CopyFrom(tags_proto(tags))
                        chunk.seed = valid.sampling.seed
                    if receipt is not None:
                        chunk.receipt.CopyFrom(receipt)
                    yield chunk
        finally:
            self.limit.release()

    async def Tag(self, request: admission_pb2.TagRequest,
                  context: grpc.aio.ServicerContext) -> admission_pb2.TagResponse:
        as_generate = admission_pb2.GenerateRequest(prompt=request.prompt, sampling=request.sampling,
                                                    tenant=request.tenant, priority=request.priority)
        _, tags = await self._admit(as_generate, context)
        return admission_pb2.TagResponse(tags=tags_proto(tags))

    # ---- steps ------------------------------------------------------------------------------------------

    async def _admit(self, request: admission_pb2.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> tuple[ValidRequest, Tags]:
        try:
            valid = validate(request, self.model)
            # The tokenizer's ratio on this very prompt turns a "50 字" limit into tokens.
            tokens_per_char = len(valid.prompt_token_ids) / len(valid.prompt)
            tags = tag(valid.prompt, len(valid.prompt_token_ids), valid.sampling.max_tokens,
                       tenant=valid.tenant, priority=valid.priority, tokens_per_char=tokens_per_char)
        except ValueError as e:  # ValidationError, or the tagger refusing the sizes it was given
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return valid, tags

    async def _acquire(self, context: grpc.aio.ServicerContext) -> None:
        """Take a slot under the concurrency cap, or refuse with RESOURCE_EXHAUSTED and a RetryInfo detail."""
        if self.limit.try_acquire():
            return
        message = (f"admission is at its limit of {self.limit.limit} concurrent requests; "
                   f"retry in {settings.OVERLOAD_RETRY_AFTER_S:g} s")
        details = retry_status_details(grpc.StatusCode.RESOURCE_EXHAUSTED, message, settings.OVERLOAD_RETRY_AFTER_S)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message, ((STATUS_DETAILS_KEY, details),))

    async def _generate(self, request: admission_pb2.GenerateRequest, valid: ValidRequest, tags: Tags,
                        context: grpc.aio.ServicerContext,
                        ) -> AsyncIterator[tuple[coordinator_pb2.TokenEvent, common_pb2.Receipt | None]]:
        """Yield the coordinator's events in order, the last one with its receipt; abort on any error."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(valid.sampling)
        sampling.max_tokens = tags.output_budget
        submit = coordinator_pb2.SubmitRequest(request_id=valid.request_id, prompt_token_ids=valid.prompt_token_ids,
                                               sampling=sampling, tenant=valid.tenant, priority=valid.priority)
        # The caller's deadline bounds the downstream call too, so the coordinator stops working on it in time.
        call = self.coordinator.Submit(submit, timeout=context.time_remaining())
        failure: tuple[grpc.StatusCode, str] | None = None
        try:
            count = 0
            async for event in call:
                if event.index != count:
                    failure = (grpc.StatusCode.INTERNAL, f"coordinator skipped a token index: expected {count}, "
                                                         f"got {event.index} (request {valid.request_id})")
                    break
                count += 1
                if event.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    yield event, None
                    continue
                yield event, common_pb2.Receipt(
                    request_id=valid.request_id, prompt_digest=prompt_digest(request.prompt),
                    prompt_tokens=len(valid.prompt_token_ids), context_hash=event.context_hash,
                    output_tokens=count, model_fingerprint=self.model_fingerprint)
                return
            else:
                failure = (grpc.StatusCode.INTERNAL, f"coordinator ended request {valid.request_id} "
                                                     f"without a finish reason after {count} tokens")
        except grpc.aio.AioRpcError as e:
            failure = (e.code(), f"coordinator {self.coordinator_target} said: {e.details()}")
        finally:
            # Runs on client disconnect and deadline too (grpc.aio cancels this task): stop the coordinator's work.
            call.cancel()
        log.warning("request %s failed: %s %s", valid.request_id, failure[0].name, failure[1])
        await context.abort(*failure)


async def track_readiness(server: Server, coordinator: grpc.aio.Channel, model_fingerprint: str,
                          interval_s: float = settings.READINESS_POLL_S) -> None:
    """Report SERVING only while the coordinator says it serves the same model; poll forever."""
    stub = coordinator_pb2_grpc.CoordinatorStub(coordinator)
    serving: bool | None = None
    reason = ""
    while True:
        try:
            stats = await stub.Stats(coordinator_pb2.StatsRequest(), timeout=interval_s)
            if not stats.serving:
                now, why = False, f"coordinator not serving: {stats.status or 'no reason given'}"
            elif stats.model_fingerprint != model_fingerprint:
                # Our tokenizer and receipts would not match its model: serving would give wrong answers.
                now, why = False, (f"coordinator serves model {stats.model_fingerprint}, "
                                   f"admission loaded {model_fingerprint}")
            else:
                now, why = True, "coordinator serving"
        except grpc.aio.AioRpcError as e:
            now, why = False, f"coordinator unreachable: {e.code().name} {e.details()}"
        if now != serving or why != reason:
            await server.set_serving(now)
            log.log(logging.INFO if now else logging.WARNING, "admission %s (%s)",
                    "SERVING" if now else "NOT_SERVING", why)
            serving, reason = now, why
        await asyncio.sleep(interval_s)
