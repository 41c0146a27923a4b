"""asyncio client of the Admission service: the same surface as `tether.client.Client`, awaited."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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


async def _sleep(retrier: Retrier, delay: float, cancelled: asyncio.Event | None = None) -> None:
    """The retrier's sleep (a plain function or a coroutine function), else asyncio's, cut short by `cancelled`."""
    if retrier.sleep is not None:
        slept = retrier.sleep(delay)
        if inspect.isawaitable(slept):
            await slept
    elif cancelled is not None:
        try:
            await asyncio.wait_for(cancelled.wait(), delay)
        except asyncio.TimeoutError:
            pass
    else:
        await asyncio.sleep(delay)


class AsyncStream(StreamCore):
    """Tokens of one request as they are generated: `async for delta in stream`.

    When iteration ends, `.result` holds the whole `GenerateResult` with its receipt checked; `.tags` and `.seed`
    are set from the first chunk on. `cancel()` cancels the request on the server; call it when you stop
    iterating early (an abandoned async iterator is only closed when it is garbage collected).

    Retries: a stream that fails with a retryable status (refused, unavailable, aborted; a reset connection or
    a dead admission reads as unavailable) is started again as a new call once the failed one has ended, like
    `generate` (same policy, budget and deadline, on the next admission of `targets`). A stream that had
    handed you tokens resumes after them (`resume_tokens`, with the seed its first chunk reported): iteration
    goes on where it stopped, no token repeated or missing, and the final receipt covers the whole answer.
    `.attempts` counts the calls made.
    """

    def __init__(self, start: Starter, prompt: Sent, request_id: str,
                 run: RetryRun, retrier: Retrier) -> None:
        self._retrier = retrier
        self._cancelled = asyncio.Event()
        super().__init__(start, prompt, request_id, run)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while True:
            try:
                try:
                    async for chunk in self._call:
                        delta = self._assembler.add(chunk)
                        yield delta
                except grpc.aio.AioRpcError as e:
                    raise from_rpc_error(e) from None
                except asyncio.CancelledError:
                    # cancel() while the call was still starting: grpc.aio raises CancelledError from inside
                    # the call rather than a CANCELLED status. Unless this task is itself being cancelled, that
                    # is the stream's cancel: a TetherError like any other, not a task that looks cancelled.
                    task = asyncio.current_task()
                    if not self._cancelled.is_set() or (task is not None and task.cancelling()):
                        raise
                    raise TetherError("the stream was cancelled (cancel())", grpc.StatusCode.CANCELLED) from None
                finally:
                    self._call.cancel()  # a no-op once the call completed; ends it before any next attempt
            except TetherError as error:
                await _sleep(self._retrier, self._retry_delay(error, self._cancelled.is_set()), self._cancelled)
                self._restart(self._cancelled.is_set())
                continue
            break
        self._finish()

    def cancel(self) -> None:
        self._cancelled.set()
        self._call.cancel()


class AsyncClient(ClientCore[AsyncStream]):
    """`AsyncClient("127.0.0.1:50051")`: awaitable generate, stream and tag. Create it inside the event loop;
    use `async with` or `await close()`.

    `timeout` and `retry` as `tether.client.Client`: the timeout bounds all of a call's attempts together;
    `retry` is a RetryPolicy, True (the default policy) or None/False (one attempt). `api_key`, `tls`,
    `tls_ca`, `tls_cert`, `tls_key` and `targets` as `Client` (defaults from TETHER_API_KEY and TETHER_TLS_*).
    """

    def __init__(self, target: str = "127.0.0.1:50051", timeout: float | None = None,
                 retry: RetryPolicy | Retrier | bool | None = True, api_key: str | None = None,
                 tls: bool | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, targets: Sequence[str] | None = None) -> None:
        super().__init__(target, timeout, retry, api_key, tls, tls_ca, tls_cert, tls_key, aio=True, targets=targets)

    async def generate(self, prompt: str | bytes, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
                       tenant: str = "", priority: str = "", request_id: str = "") -> GenerateResult:
        """The whole answer, receipt checked. `prompt` str is sent as UTF-8, bytes as they are.

        Retried per the client's policy; every attempt is a new call made after the previous one ended, and
        its answer's receipt is checked. `.attempts` on the result says how many were made."""
        sent, request = sent_and_request(prompt, None, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, tenant=tenant,
                                         priority=priority, request_id=request_id)
        return await self._unary(request, sent, request_id)

    async def chat(self, messages: Messages, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
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
        return await self._unary(request, sent, request_id)

    async def tag(self, prompt: str | bytes | None = None, max_tokens: int = 64, tenant: str = "",
                  priority: str = "", *, messages: Messages | None = None) -> dict[str, Any]:
        """The intent tags admission would give this prompt or conversation, without generating (dry run;
        retried like `generate`, as it takes the same concurrency slot)."""
        request = self._tag_request(prompt, max_tokens, tenant, priority, messages)

        async def attempt(timeout: float | None, stub: admission_pb2_grpc.AdmissionStub) -> dict[str, Any]:
            try:
                return tags_dict((await stub.Tag(request, timeout=timeout, metadata=self._metadata())).tags)
            except grpc.aio.AioRpcError as e:
                raise from_rpc_error(e) from None
        return (await self._with_retries(attempt))[0]

    async def _unary(self, request: admission_pb2.GenerateRequest, sent: Sent, request_id: str) -> GenerateResult:
        async def attempt(timeout: float | None, stub: admission_pb2_grpc.AdmissionStub) -> GenerateResult:
            try:
                response = await stub.Generate(request, timeout=timeout, metadata=self._metadata())
            except grpc.aio.AioRpcError as e:
                raise from_rpc_error(e) from None
            return result_from_response(response, sent, request_id)   # each attempt's receipt is checked
        result, attempts = await self._with_retries(attempt)
        result.attempts = attempts
        return result

    async def _with_retries(self, attempt: Callable[[float | None, Any], Awaitable[T]]) -> tuple[T, int]:
        """Await `attempt(timeout, stub)` until it returns or the policy gives up (`UnaryRun`)."""
        run = self._unary_run()
        while True:
            try:
                return await attempt(*run.next_attempt()), run.attempts
            except TetherError as error:
                delay = run.delay_after(error)
            await _sleep(self.retrier, delay)

    def _stream(self, request: admission_pb2.GenerateRequest, sent: Sent, request_id: str) -> AsyncStream:
        return AsyncStream(self._stream_starter(request), sent, request_id, self.retrier.begin(self.timeout),
                           self.retrier)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
