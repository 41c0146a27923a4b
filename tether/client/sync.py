"""Blocking client of the Admission service."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from tether.client.common import ClientCore, Starter, StreamCore
from tether.client.errors import TetherError, from_rpc_error
from tether.client.receipt import Sent
from tether.client.retry import Retrier, RetryPolicy, RetryRun
from tether.client.wire import GenerateResult, Messages, result_from_response, sent_and_request, tags_dict
from tether.types import Delta
from tether.v1 import admission_pb2, admission_pb2_grpc

T = TypeVar("T")


class Stream(StreamCore):
    """Tokens of one request as they are generated.

    Iterate it (once) for `Delta`s. When iteration ends, `.result` holds the whole `GenerateResult` with its
    receipt checked; `.tags` (dict) and `.seed` (the sampling seed used) are set from the first chunk on.
    Stopping early (break) or `cancel()` cancels the request on the server.
    Raises TetherError subclasses, ReceiptMismatch included, from the iteration.

    Retries: a stream that fails with a retryable status (refused, unavailable, aborted; a reset connection or
    a dead admission reads as unavailable) is started again as a new call once the failed one has ended, like
    `generate` (same policy, budget and deadline, on the next admission of `targets`). A stream that had
    handed you tokens resumes after them (`resume_tokens`, with the seed its first chunk reported): iteration
    goes on where it stopped, no token repeated or missing, and the final receipt covers the whole answer.
    `.attempts` counts the calls made.
    """

    def __init__(self, start: Starter, prompt: Sent, request_id: str, run: RetryRun,
                 sleep: Callable[[float], object] | None) -> None:
        self._cancelled = threading.Event()
        self._sleep = sleep if sleep is not None else self._cancelled.wait   # a cancel() cuts the wait short
        super().__init__(start, prompt, request_id, run)

    def __iter__(self) -> Iterator[Delta]:
        while True:
            try:
                try:
                    for chunk in self._call:
                        delta = self._assembler.add(chunk)
                        yield delta
                except grpc.RpcError as e:
                    raise from_rpc_error(e) from None
                finally:
                    self._call.cancel()  # a no-op once the call completed; ends it before any next attempt
            except TetherError as error:
                self._sleep(self._retry_delay(error, self._cancelled.is_set()))
                self._restart(self._cancelled.is_set())
                if self._cancelled.is_set():   # cancel() raced with the start: end the new call too
                    self._call.cancel()
                continue
            break
        self._finish()

    def cancel(self) -> None:
        self._cancelled.set()
        self._call.cancel()


class Client(ClientCore[Stream]):
    """`Client("127.0.0.1:50051")`: generate, stream and tag against an admission service.

    `timeout` (seconds) bounds every call, all its attempts together; None waits as long as the server takes.
    `retry`: a `RetryPolicy` (tether.client.retry), True for the default one (3 attempts, full-jitter
    backoff honouring the server's RetryInfo, a retry budget of 10% of requests), None or False for a single
    attempt. Refused (RESOURCE_EXHAUSTED with RetryInfo), unavailable and aborted calls are retried; a
    result's `.attempts` and an error's `.attempts` / `.gave_up` tell what happened.
    `api_key`: sent as `authorization: Bearer <key>` on every call (default: $TETHER_API_KEY); admission maps it
    to your tenant. TLS: `tls_ca` (PEM path verifying admission; default $TETHER_TLS_CA), `tls_cert` and
    `tls_key` (a client certificate, when admission asks for one; $TETHER_TLS_CERT, $TETHER_TLS_KEY); any of
    them turns TLS on, `tls=True` with the system's roots, `tls=False` forces plaintext.
    `targets`: several admissions (HOST:PORT each) instead of `target`: calls take turns over them, and a retry
    (a refused call, a broken stream) goes to the next one.
    Use as a context manager or call `close()`.
    """

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None,
                 retry: RetryPolicy | Retrier | bool | None = True, api_key: str | None = None,
                 tls: bool | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, targets: Sequence[str] | None = None) -> None:
        super().__init__(target, timeout, retry, api_key, tls, tls_ca, tls_cert, tls_key, aio=False, targets=targets)

    def generate(self, prompt: str | bytes, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
                 tenant: str = "", priority: str = "", request_id: str = "") -> GenerateResult:
        """The whole answer, receipt checked. `prompt` str is sent as UTF-8, bytes as they are.

        Retried per the client's policy; every attempt is a new call made after the previous one ended, and
        its answer's receipt is checked. `.attempts` on the result says how many were made."""
        sent, request = sent_and_request(prompt, None, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, tenant=tenant,
                                         priority=priority, request_id=request_id)
        return self._unary(request, sent, request_id)

    def chat(self, messages: Messages, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
             tenant: str = "", priority: str = "", request_id: str = "") -> GenerateResult:
        """The assistant's reply to a conversation, receipt checked; other parameters (and retries) as `generate`.

        `messages`: [{"role": "user", "content": "Hi"}, ...] or [("user", "Hi"), ...]; roles system (first
        message only), user and assistant, the last one the user's. Admission renders them with the model's
        chat template; a conversation over the model's limits is refused (InvalidArgument), never truncated.
        """
        sent, request = sent_and_request(None, messages, max_tokens=max_tokens, temperature=temperature,
                                         top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos,
                                         tenant=tenant, priority=priority, request_id=request_id)
        return self._unary(request, sent, request_id)

    def tag(self, prompt: str | bytes | None = None, max_tokens: int = 64, tenant: str = "", priority: str = "",
            *, messages: Messages | None = None) -> dict[str, Any]:
        """The intent tags admission would give this prompt or conversation, without generating (dry run;
        retried like `generate`, as it takes the same concurrency slot)."""
        request = self._tag_request(prompt, max_tokens, tenant, priority, messages)

        def attempt(timeout: float | None, stub: admission_pb2_grpc.AdmissionStub) -> dict[str, Any]:
            try:
                return tags_dict((stub.Tag(request, timeout=timeout, metadata=self._metadata())).tags)
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
        return self._with_retries(attempt)[0]

    def _unary(self, request: admission_pb2.GenerateRequest, sent: Sent, request_id: str) -> GenerateResult:
        def attempt(timeout: float | None, stub: admission_pb2_grpc.AdmissionStub) -> GenerateResult:
            try:
                response = stub.Generate(request, timeout=timeout, metadata=self._metadata())
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
            return result_from_response(response, sent, request_id)   # each attempt's receipt is checked
        result, attempts = self._with_retries(attempt)
        result.attempts = attempts
        return result

    def _with_retries(self, attempt: Callable[[float | None, Any], T]) -> tuple[T, int]:
        """Run `attempt(timeout, stub)` until it returns or the policy gives up (`UnaryRun`)."""
        run = self._unary_run()
        sleep = self.retrier.sleep if self.retrier.sleep is not None else time.sleep
        while True:
            try:
                return attempt(*run.next_attempt()), run.attempts
            except TetherError as error:
                delay = run.delay_after(error)
            sleep(delay)

    def _stream(self, request: admission_pb2.GenerateRequest, sent: Sent, request_id: str) -> Stream:
        return Stream(self._stream_starter(request), sent, request_id, self.retrier.begin(self.timeout),
                      self.retrier.sleep)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
