"""The HTTP routes (FastAPI): each turns a request into a `Call` and a GenerateRequest, runs it through the
same `FrontDoor.handle` as gRPC, and writes the door's events back as JSON or Server-Sent Events.

A refusal before the first token is an HTTP status with OpenAI's error body; one after the stream started (the
status line is gone) is an `error` event, then the stream ends without `[DONE]`, so no client takes a cut-off
answer for a whole one. A client that closes the connection cancels its request: sse-starlette cancels the
stream's task, and the door's exit path cancels it on the coordinator, which releases it on every stage.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from services.admission.door import FrontDoor
from services.admission.openai_api.schema import ChatCompletionRequest, CompletionRequest
from services.admission.openai_api.translate import (BadRequest, Shape, error_body, generate_request,
                                                     rejected_response, tether_object, validation_message)
from services.admission.outcome import Call
from services.admission.server import tags_proto
from services.admission.status import Rejected
from tether import settings

log = logging.getLogger(__name__)

TIMEOUT_HEADER = "x-request-timeout"   # seconds the caller will wait: the request's deadline, as gRPC's


def _error(status: int, body: dict, headers: dict[str, str] | None = None,
           request_id: str | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(body, status_code=status, headers=headers)


def _bad(e: BadRequest, request_id: str | None = None) -> JSONResponse:
    return _error(400, error_body(e.message, "invalid_request_error", "invalid_argument", e.param), None, request_id)


def build_app(door: FrontDoor) -> FastAPI:
    app = FastAPI(title="tether", docs_url=None, redoc_url=None, openapi_url=None)   # no schema browser on a public port
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _bad(validation_message(list(e.errors())), request.headers.get("x-request-id"))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        what = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return _error(e.status_code, error_body(what, type_, str(e.status_code)))

    @app.get("/health")
    async def health() -> JSONResponse:
        if door.ready:
            return JSONResponse({"status": "SERVING"})
        return _error(503, error_body(f"admission is not ready: {door.not_ready_reason}",
                                      "service_unavailable_error", "unavailable"))

    def model_card() -> dict:
        return {"id": door.model_name, "object": "model", "created": started, "owned_by": "tether",
                "root": door.model_fingerprint, "max_model_len": door.model.max_context}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model != door.model_name:
            return _error(404, _unknown_model(door, model))
        return JSONResponse(model_card())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await _serve(door, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(door, body, request, chat=False)

    return app


def _unknown_model(door: FrontDoor, model: str) -> dict:
    return error_body(f"model {model[:200]!r} is not served here; this server serves {door.model_name!r} "
                      f"(GET /v1/models)", "not_found_error", "model_not_found", "model")


def _call(request: Request, method: str) -> Call:
    """The door's view of an HTTP request: its headers (authorization, traceparent) and deadline."""
    deadline = None
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is not None:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds <= 86400:
            raise BadRequest(TIMEOUT_HEADER, f"{TIMEOUT_HEADER} must be a number of seconds in (0, 86400]; got {raw[:40]!r}")
        deadline = time.monotonic() + seconds
    return Call(method, list(request.headers.items()), deadline,
                {"http.request.method": "POST", "url.path": request.url.path, "rpc.system": "http"})


def _label(body: ChatCompletionRequest | CompletionRequest, request: Request) -> tuple[str, str]:
    header_id, header_priority = request.headers.get("x-request-id"), request.headers.get("x-priority")
    if body.request_id is not None and header_id is not None and body.request_id != header_id:
        raise BadRequest("request_id", "request_id in the body and the x-request-id header differ; send one")
    if body.priority is not None and header_priority is not None and body.priority != header_priority:
        raise BadRequest("priority", "priority in the body and the x-priority header differ; send one")
    return body.request_id or header_id or "", body.priority or header_priority or ""


async def _serve(door: FrontDoor, body: ChatCompletionRequest | CompletionRequest, request: Request, chat: bool):
    caller_label = request.headers.get("x-request-id")
    if body.model and body.model != door.model_name:
        return _error(404, _unknown_model(door, body.model), request_id=caller_label)
    try:
        call = _call(request, "POST " + request.url.path)
        label, priority = _label(body, request)
        message = generate_request(body, label, priority)
    except BadRequest as e:
        return _bad(e, caller_label)
    stack = AsyncExitStack()
    try:
        a, routed, events = await stack.enter_async_context(door.handle(call, message))
    except Rejected as e:
        return _error(*rejected_response(e), request_id=caller_label)
    shape = Shape(chat, ("chatcmpl-" if chat else "cmpl-") + a.internal_id, int(time.time()), door.model_name,
                  door.model_fingerprint)
    headers = {"x-request-id": label or a.internal_id}
    tags = tags_proto(a.tags, routed)
    if not body.stream:
        text: list[str] = []
        ids: list[int] = []
        try:
            async for event, receipt in events:
                text.append(event.text)
                ids.append(event.token_id)
                if receipt is not None:
                    finish, last = event.finish_reason, receipt
        except BaseException as e:
            return await _refused(stack, e, headers["x-request-id"])
        await stack.aclose()
        return JSONResponse(shape.answer("".join(text), finish, last, tether_object(a, tags, last, finish),
                                         ids if body.return_token_ids else None), headers=headers)
    # Stream: the first event is awaited here, so a refusal before any token still gets its HTTP status.
    try:
        first = await anext(events)
    except BaseException as e:
        return await _refused(stack, e, headers["x-request-id"])
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventSourceResponse(_sse(shape, a, tags, first, events, stack, include_usage, body.return_token_ids),
                               headers=headers,
                               sep="\n", ping=settings.HTTP_SSE_PING_S)


async def _leave(stack: AsyncExitStack, e: BaseException) -> Rejected:
    """Leave the door's context with the exception the request ended with (its outcome records it); re-raise
    it unless it is a Rejected, which is returned for the caller to word as OpenAI's error."""
    try:
        await stack.__aexit__(type(e), e, e.__traceback__)
    except Rejected as raised:
        if raised is not e:
            raise
        return raised
    if not isinstance(e, Rejected):
        raise e
    return e


async def _refused(stack: AsyncExitStack, e: BaseException, request_id: str) -> JSONResponse:
    rejected = await _leave(stack, e)
    return _error(*rejected_response(rejected), request_id=request_id)


async def _sse(shape: Shape, a, tags, first, events: AsyncIterator, stack: AsyncExitStack,
               include_usage: bool, with_ids: bool) -> AsyncIterator[dict]:
    """The chunks of one streamed answer, as OpenAI sends them; the door's context closes however it ends."""
    def data(obj: dict) -> dict:
        return {"data": json.dumps(obj, ensure_ascii=False, separators=(",", ":"))}

    try:
        if shape.chat:
            yield data(shape.chunk(role=True, with_usage=include_usage))
        event, receipt = first
        while True:
            # A delta is one token's text as the coordinator's detokenizer completed it: whole characters only
            # (a token ending inside a UTF-8 sequence has "" until the character is complete), never split.
            if event.text or with_ids:   # with ids, a token without text of its own still has its chunk
                yield data(shape.chunk(event.text, with_usage=include_usage,
                                       token_ids=[event.token_id] if with_ids else None))
            if receipt is not None:
                tether = tether_object(a, tags, receipt, event.finish_reason)
                yield data(shape.chunk(finish=event.finish_reason, with_usage=include_usage, tether=tether))
                if include_usage:
                    yield data(shape.usage_chunk(receipt, tether))
                break
            event, receipt = await anext(events)
    except BaseException as e:   # a failure after the status line, the client gone (cancelled), or a bug
        rejected = await _leave(stack, e)      # re-raises all but a Rejected
        yield data(rejected_response(rejected)[1])   # a Rejected: an error event, and no [DONE]
        return
    await stack.aclose()
    yield {"data": "[DONE]"}
