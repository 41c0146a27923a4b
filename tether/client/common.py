"""What the blocking and the asyncio clients share: the connection to admission and a stream's retry rules.

`Client` (sync.py) and `AsyncClient` (aio.py) differ only where one blocks and the other awaits; everything
decided without waiting (which channel, which metadata, whether and when a failed stream starts again) is here,
written once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from tether.client.credentials import call_metadata, open_channel, resolve
from tether.client.errors import TetherError
from tether.client.receipt import Sent
from tether.client.retry import STREAM_STARTED, Retrier, RetryPolicy, RetryRun, make_retrier
from tether.client.tracecontext import trace_metadata
from tether.client.wire import GenerateResult, StreamAssembler
from tether.v1 import admission_pb2, admission_pb2_grpc


class StreamCore:
    """One streamed request across its attempts: the call in progress, the assembler of its chunks, and the
    retry rule (again as a new call only while no token has reached the caller, as the policy allows)."""

    def __init__(self, start: Callable[[float | None], Any], prompt: Sent, request_id: str, run: RetryRun) -> None:
        self._start = start
        self._prompt, self._request_id = prompt, request_id
        self._run = run
        self._delivered = False      # a Delta reached the caller: no retry from then on
        self._call = start(run.attempt_timeout())
        self._assembler = StreamAssembler(prompt, request_id)
        self.result: GenerateResult | None = None

    @property
    def tags(self) -> dict[str, Any]:
        return self._assembler.tags

    @property
    def seed(self) -> int:
        return self._assembler.seed

    @property
    def internal_id(self) -> str:
        """The id admission minted for this request (set with the first token; "" before)."""
        return self._assembler.internal_id

    @property
    def attempts(self) -> int:
        """Calls made for this stream so far: 1, or more after retries before the first token."""
        return self._run.attempts

    def _retry_delay(self, error: TetherError, cancelled: bool) -> float:
        """Seconds to wait before the next attempt after `error`; raises `error` when there is none: a token
        was delivered (tokens shown cannot be taken back), the caller cancelled, or the policy gives up."""
        if self._delivered or cancelled:
            error.attempts = self._run.attempts
            if self._delivered:
                error.gave_up = STREAM_STARTED
            raise error
        delay = self._run.after_failure(error)
        if delay is None:
            raise error
        return delay

    def _restart(self, cancelled: bool) -> None:
        """Start the next attempt as a new call with a fresh assembler (unless cancelled during the wait)."""
        if cancelled:
            raise TetherError("the stream was cancelled while waiting to retry", grpc.StatusCode.CANCELLED) from None
        self._assembler = StreamAssembler(self._prompt, self._request_id)
        self._call = self._start(self._run.attempt_timeout())

    def _finish(self) -> None:
        self.result = self._assembler.finish()
        self.result.attempts = self._run.attempts


class ClientCore:
    """A client's connection: its channel and stub to admission, its retrier, and every call's metadata."""

    def __init__(self, target: str, timeout: float | None, retry: RetryPolicy | Retrier | bool | None,
                 api_key: str | None, tls: bool | None, tls_ca: str | None, tls_cert: str | None,
                 tls_key: str | None, aio: bool) -> None:
        self.timeout = timeout
        self.retrier = make_retrier(retry)
        self._conn = resolve(api_key, tls, tls_ca, tls_cert, tls_key)
        self._channel = open_channel(target, self._conn, aio=aio)
        self._stub = admission_pb2_grpc.AdmissionStub(self._channel)

    def _stream_starter(self, request: admission_pb2.GenerateRequest) -> Callable[[float | None], Any]:
        """Starts one attempt of a GenerateStream call with the given timeout."""
        metadata = self._metadata()   # the caller's span where it asked, whenever the attempts run
        return lambda timeout: self._stub.GenerateStream(request, timeout=timeout, metadata=metadata)

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Every call's metadata: the API key, and the caller's current span (tracecontext.py)."""
        return call_metadata(self._conn, trace_metadata())
