"""What the blocking and the asyncio clients share: the connection to admission, the requests they send, and
the retry rules of a unary call and of a stream.

`Client` (sync.py) and `AsyncClient` (aio.py) differ only where one blocks and the other awaits; everything
decided without waiting (which channel, which metadata, which request, whether and when a failed call or stream
starts again, and `stream` / `stream_chat`, which only start a stream) is here, written once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import grpc

from tether.client.credentials import call_metadata, open_channel, resolve
from tether.client.errors import TetherError
from tether.client.receipt import Sent
from tether.client.retry import Retrier, RetryPolicy, RetryRun, make_retrier
from tether.client.tracecontext import trace_metadata
from tether.client.wire import (GenerateResult, Messages, StreamAssembler, encode_messages, encode_prompt,
                                sent_and_request, tag_request)
from tether.v1 import admission_pb2, admission_pb2_grpc

S = TypeVar("S")   # a client's stream: Stream (sync.py) or AsyncStream (aio.py)


# Starts one attempt of a stream: (gRPC timeout, attempt number from 1, tokens the caller already has, the seed
# to continue them with) -> the call.
Starter = Callable[[float | None, int, Sequence[int], int], Any]


def delay_or_give_up(run: RetryRun, error: TetherError) -> float:
    """Seconds to wait before the next attempt of `run` after `error`; raises `error` when the policy (attempts,
    deadline, budget, a status not worth retrying) gives up."""
    delay = run.after_failure(error)
    if delay is None:
        raise error
    return delay


class UnaryRun:
    """The attempts of one unary call (Generate, Tag): each one's gRPC timeout and admission, and the wait
    after a failed one. A unary call has ended (answered or failed) when the client's blocking call or its
    await returns, so attempts never overlap."""

    def __init__(self, run: RetryRun, stub_for: Callable[[int], Any]) -> None:
        self._run, self._stub_for = run, stub_for

    @property
    def attempts(self) -> int:
        return self._run.attempts

    def next_attempt(self) -> tuple[float | None, Any]:
        """Count a new attempt: (its gRPC timeout, what is left of the call's; the stub of its admission, the
        next one in turn on every retry, when there are several)."""
        timeout = self._run.attempt_timeout()
        return timeout, self._stub_for(self._run.attempts)

    def delay_after(self, error: TetherError) -> float:
        """Seconds to wait before the next attempt; raises `error` when there is none (`delay_or_give_up`)."""
        return delay_or_give_up(self._run, error)


class StreamCore:
    """One streamed request across its attempts: the call in progress, the assembler of its chunks, and the
    retry rule: a failed attempt is followed, as the policy and budget allow, by a new call that resumes after
    the tokens already handed to the caller (`resume_tokens`, with the seed the first chunk reported), so the
    caller's iteration goes on where it stopped, with no token repeated or missing."""

    def __init__(self, start: Starter, prompt: Sent, request_id: str, run: RetryRun) -> None:
        self._start = start
        self._prompt, self._request_id = prompt, request_id
        self._run = run
        self._call = start(run.attempt_timeout(), run.attempts, (), 0)
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
        """Calls made for this stream so far: 1, or more after retries (each resuming where the last stopped)."""
        return self._run.attempts

    def _retry_delay(self, error: TetherError, cancelled: bool) -> float:
        """Seconds to wait before the next attempt after `error`; raises `error` when there is none: the caller
        cancelled, or the policy (attempts, deadline, budget, a status not worth retrying) gives up."""
        if cancelled:
            error.attempts = self._run.attempts
            raise error
        return delay_or_give_up(self._run, error)

    def _restart(self, cancelled: bool) -> None:
        """Start the next attempt as a new call (unless cancelled during the wait): after the tokens the caller
        already has, which the new assembler carries on from."""
        if cancelled:
            raise TetherError("the stream was cancelled while waiting to retry", grpc.StatusCode.CANCELLED) from None
        had = self._assembler
        self._assembler = StreamAssembler(self._prompt, self._request_id, after=had)
        self._call = self._start(self._run.attempt_timeout(), self._run.attempts, had.token_ids, had.seed)

    def _finish(self) -> None:
        self.result = self._assembler.finish()
        self.result.attempts = self._run.attempts


class ClientCore(Generic[S]):
    """A client's connection: its channel and stub to admission, its retrier, and every call's metadata; the
    requests its calls send; and `stream` and `stream_chat`, which neither block nor await (the stream `S`
    returned does, as it is iterated)."""

    def __init__(self, target: str, timeout: float | None, retry: RetryPolicy | Retrier | bool | None,
                 api_key: str | None, tls: bool | None, tls_ca: str | None, tls_cert: str | None,
                 tls_key: str | None, aio: bool, targets: Sequence[str] | None = None) -> None:
        self.timeout = timeout
        self.retrier = make_retrier(retry)
        self._conn = resolve(api_key, tls, tls_ca, tls_cert, tls_key)
        if isinstance(targets, str):
            raise TypeError("targets must be a list of HOST:PORT addresses; for one, use target=")
        self.targets = list(targets) if targets else [target]
        self._channels = [open_channel(t, self._conn, aio=aio) for t in self.targets]
        self._stubs = [admission_pb2_grpc.AdmissionStub(ch) for ch in self._channels]
        self._stub, self._channel = self._stubs[0], self._channels[0]
        self._turns = itertools.count()   # which admission a call tries first: round robin over the targets

    def stream(self, prompt: str | bytes, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
               tenant: str = "", priority: str = "", request_id: str = "") -> S:
        """Start a request and return its stream: a `Stream` from `Client`, an `AsyncStream` from `AsyncClient`
        (not awaited: iterate it). See there: a broken stream resumes where it stopped. Same parameters as
        `generate`."""
        sent, request = sent_and_request(prompt, None, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, tenant=tenant,
                                         priority=priority, request_id=request_id)
        return self._stream(request, sent, request_id)

    def stream_chat(self, messages: Messages, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 0.0, seed: int = 0, stop: Sequence[str] = (), ignore_eos: bool = False,
                    tenant: str = "", priority: str = "", request_id: str = "") -> S:
        """Start the assistant's reply to a conversation (as `chat`) and return its stream, as `stream` does (a
        broken stream resumes where it stopped)."""
        sent, request = sent_and_request(None, messages, max_tokens=max_tokens, temperature=temperature,
                                         top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos,
                                         tenant=tenant, priority=priority, request_id=request_id)
        return self._stream(request, sent, request_id)

    def _stream(self, request: admission_pb2.GenerateRequest, sent: Sent, request_id: str) -> S:
        """The client's stream of `request`, its first attempt started (`_stream_starter`)."""
        raise NotImplementedError

    @staticmethod
    def _tag_request(prompt: str | bytes | None, max_tokens: int, tenant: str, priority: str,
                     messages: Messages | None) -> admission_pb2.TagRequest:
        """The TagRequest of `tag`: a prompt or a conversation, encoded as `generate` sends them."""
        pairs = encode_messages(messages) if messages is not None else ()
        data = encode_prompt(prompt) if prompt is not None else b""
        return tag_request(data, max_tokens=max_tokens, tenant=tenant, priority=priority, messages=pairs)

    def _unary_run(self) -> UnaryRun:
        """The attempts of one unary call: the retrier's run over this client's timeout, its admissions in turn."""
        return UnaryRun(self.retrier.begin(self.timeout), self._stub_picker())

    def _stub_picker(self) -> Callable[[int], Any]:
        """For one call: the stub of its attempt n (from 1), starting at the next admission in turn and moving
        to the following one on every retry, so a call that lost its admission tries another."""
        first = next(self._turns)
        return lambda attempt: self._stubs[(first + attempt - 1) % len(self._stubs)]

    def _stream_starter(self, request: admission_pb2.GenerateRequest) -> Starter:
        """Starts one attempt of a GenerateStream call: with the given timeout, on its attempt's admission,
        resuming after `resume` (the tokens the caller already has) with `seed` (the one the first chunk
        reported: an answer that was sampled continues with the seed admission drew for it)."""
        metadata = self._metadata()   # the caller's span where it asked, whenever the attempts run
        stub_for = self._stub_picker()

        def start(timeout: float | None, attempt: int, resume: Sequence[int], seed: int) -> Any:
            sent = request
            if resume:
                sent = admission_pb2.GenerateRequest()
                sent.CopyFrom(request)
                sent.resume_tokens[:] = resume
                if seed:
                    sent.sampling.seed = seed
            return stub_for(attempt).GenerateStream(sent, timeout=timeout, metadata=metadata)
        return start

    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Every call's metadata: the API key, and the caller's current span (tracecontext.py)."""
        return call_metadata(self._conn, trace_metadata())
