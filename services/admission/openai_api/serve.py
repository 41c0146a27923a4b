"""The HTTP face's server: uvicorn on admission's own asyncio loop, beside grpc.aio (one process, one loop,
one FrontDoor), with TLS from the same --tls-* files as the gRPC port, and the request body bounded as gRPC
bounds its messages."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.admission.openai_api.translate import error_body
from tether import settings

log = logging.getLogger(__name__)


class _LoopServer(uvicorn.Server):
    """uvicorn.Server that leaves the signals to admission (grpcutil.Server.wait_for_signal): admission stops
    it by setting `should_exit`, after the gRPC server has stopped taking calls."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is refused with 413 (OpenAI's error shape) before it
    is buffered, whether it declares its length or not."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._refuse(send)
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, bounded, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(error_body(f"the request body is larger than {self.limit} bytes", "invalid_request_error",
                                     "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class HttpFace:
    """The listening HTTP server: `start()` binds (port 0 picks a free one; OSError when taken) and serves in
    a task on the running loop; `stop()` lets in-flight requests finish for `grace_s`."""

    def __init__(self, app: ASGIApp, host: str, port: int, tls_files: tuple[str, str, str] | None = None,
                 require_client_auth: bool = False) -> None:
        kwargs: dict[str, Any] = {}
        if tls_files is not None:
            ca, cert, key = tls_files
            kwargs = dict(ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=ca,
                          ssl_cert_reqs=ssl.CERT_REQUIRED if require_client_auth else ssl.CERT_NONE)
        self.config = uvicorn.Config(BodyLimit(app, settings.ADMISSION_MAX_MESSAGE_BYTES), lifespan="off",
                                     log_config=None, access_log=False, server_header=False,
                                     limit_concurrency=settings.HTTP_MAX_CONNECTIONS,
                                     timeout_keep_alive=int(settings.HTTP_KEEPALIVE_S),
                                     timeout_graceful_shutdown=5, **kwargs)
        self.tls = tls_files is not None
        self.host = host
        self.sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self.sock.getsockname()[1]
        self.server = _LoopServer(self.config)
        self.task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/v1"

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]), name="http-face")
        while not self.server.started:
            if self.task.done():
                self.task.result()   # raises why it could not start
                raise OSError(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.task
