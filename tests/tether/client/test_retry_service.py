"""The SDK's retries (and the CLI's --retries) over real gRPC: a small Admission server on 127.0.0.1 that
follows a script (refuse with a status and a RetryInfo detail as admission does, answer, or stream some tokens
then fail), checked with the blocking and the asyncio client. Time is an injected clock that only the injected
sleep moves, so the delays the SDK honours are asserted exactly and nothing waits on the wall clock (the CLI
tests alone sleep for real, a few hundredths of a second plus jitter, and assert no timing)."""

from __future__ import annotations

import asyncio
import io
import threading
from dataclasses import dataclass, field

import grpc
import pytest

from services.admission.status import retry_status_details
from tether.cli import chat, generate
from tether.client import (AsyncClient, Client, InvalidArgument, ReceiptMismatch, ResourceExhausted, Retrier,
                           RetryBudget, RetryPolicy, TetherError, Unavailable)
from tether.client.errors import STATUS_DETAILS_KEY
from tether.protocol.hashing import prompt_digest
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2

C = grpc.StatusCode
ANSWER = ("answer",)


def refuse(code: grpc.StatusCode = C.RESOURCE_EXHAUSTED, retry_after: float | None = 1.5) -> tuple:
    return ("refuse", code, retry_after)


@dataclass
class Call:
    prompt: bytes
    request_id: str
    resume: list          # the resume_tokens it carried
    started: int                  # ticks of the server's event counter: the order calls began and ended
    ended: int = -1


@dataclass
class FakeAdmission(admission_pb2_grpc.AdmissionServicer):
    """Plays `script` one outcome per call (the last one repeats), keeps admission's label rule (a label in
    flight is ALREADY_EXISTS) and records every call's start and end."""

    script: list[tuple] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    labels: set[str] = field(default_factory=set)
    ticks: int = 0
    active: int = 0
    max_active: int = 0

    def _tick(self) -> int:
        self.ticks += 1
        return self.ticks

    def _next(self, request: admission_pb2.GenerateRequest) -> tuple[tuple, Call]:
        call = Call(request.prompt, request.request_id, list(request.resume_tokens), self._tick())
        self.calls.append(call)
        return self.script[min(len(self.calls), len(self.script)) - 1], call

    async def _begin(self, request: admission_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                     ) -> tuple[tuple, Call]:
        """This call's scripted outcome and record, once admission's label rule let it in."""
        outcome, call = self._next(request)
        if not self._enter(request):
            await context.abort(C.ALREADY_EXISTS, f"request_id {request.request_id!r} is already in flight")
        return outcome, call

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, retry_after: float | None):
        message = f"scripted refusal {len(self.calls)}"
        metadata = () if retry_after is None else ((STATUS_DETAILS_KEY,
                                                    retry_status_details(code, message, retry_after)),)
        await context.abort(code, message, metadata)

    def _enter(self, request: admission_pb2.GenerateRequest) -> bool:
        if request.request_id and request.request_id in self.labels:
            return False
        if request.request_id:
            self.labels.add(request.request_id)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        return True

    def _leave(self, request: admission_pb2.GenerateRequest, call: Call) -> None:
        self.labels.discard(request.request_id)
        self.active -= 1
        call.ended = self._tick()

    @staticmethod
    def _receipt(request: admission_pb2.GenerateRequest, n: int, digest_of: bytes | None = None) -> common_pb2.Receipt:
        return common_pb2.Receipt(request_id=request.request_id, output_tokens=n, model_fingerprint="fake",
                                  prompt_digest=prompt_digest(request.prompt if digest_of is None else digest_of))

    async def Generate(self, request, context):
        outcome, call = await self._begin(request, context)
        try:
            if outcome[0] == "refuse":
                await self._refuse(context, *outcome[1:])
            digest_of = b"someone else's prompt" if outcome[0] == "bad_receipt" else None
            return admission_pb2.GenerateResponse(text="ok", token_ids=[1, 2],
                                                  receipt=self._receipt(request, 2, digest_of),
                                                  finish_reason=common_pb2.FINISH_REASON_LENGTH)
        finally:
            self._leave(request, call)

    async def GenerateStream(self, request, context):
        outcome, call = await self._begin(request, context)
        try:
            if outcome[0] == "refuse":
                await self._refuse(context, *outcome[1:])
            if outcome[0] == "hold":             # nothing sent yet, not even the headers: a call still starting
                await asyncio.sleep(outcome[1])
            n, fail = (outcome[1], outcome[2]) if outcome[0] == "tokens_then" else (3, None)
            start = len(request.resume_tokens)    # a resumed call goes on after them, as admission does
            if fail is not None:
                n += start
            for i in range(start, n):
                chunk = admission_pb2.GenerateChunk(index=i, token_id=10 + i, text=f"t{i}")
                if fail is None and i == n - 1:
                    chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    chunk.receipt.CopyFrom(self._receipt(request, n))
                yield chunk
            if fail is not None:
                await self._refuse(context, fail, None)
        finally:
            self._leave(request, call)

    def sequential(self) -> bool:
        """Every call ended before the next one began: the same request never ran twice at once."""
        return all(a.ended < b.started for a, b in zip(self.calls, self.calls[1:])) and self.max_active == 1


class Server:
    """A grpc.aio server on its own thread and event loop, so the blocking client can call it too."""

    def __init__(self, servicer: FakeAdmission) -> None:
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.target = f"127.0.0.1:{self.port}"

    async def _start(self) -> int:
        self.server = grpc.aio.server()
        admission_pb2_grpc.add_AdmissionServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def admission():
    servers = []

    def start(*script: tuple) -> Server:
        servers.append(Server(FakeAdmission(list(script))))
        return servers[-1]
    yield start
    for s in servers:
        s.stop()


class FakeTime:
    """The retrier's clock, random source and sleep: sleeping is the only thing that moves the clock."""

    def __init__(self, rand: float = 0.0) -> None:
        self.now, self.rand, self.sleeps = 1000.0, rand, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def retrier(self, policy: RetryPolicy | None = None, budget: RetryBudget | None = None) -> Retrier:
        return Retrier(policy or RetryPolicy(), budget, clock=self.clock, rand=lambda: self.rand, sleep=self.sleep)


# ---- the blocking client --------------------------------------------------------------------------------------

def test_refusals_are_retried_after_the_servers_delay_plus_jitter(admission):
    server = admission(refuse(retry_after=1.5), refuse(retry_after=1.5), ANSWER)
    t = FakeTime(rand=0.5)
    with Client(server.target, timeout=30, retry=t.retrier(RetryPolicy(base_backoff_s=0.5))) as client:
        result = client.generate("hello", max_tokens=2, request_id="r-1")
    assert result.text == "ok" and result.attempts == 3 and result.receipt.request_id == "r-1"
    # RetryInfo is the floor; full jitter (0.5 of the cap: 0.5 s, then 1 s) on top
    assert t.sleeps == pytest.approx([1.5 + 0.25, 1.5 + 0.5])
    assert len(server.servicer.calls) == 3 and server.servicer.sequential()


def test_an_answer_at_once_is_one_attempt(admission):
    server = admission(ANSWER)
    t = FakeTime()
    with Client(server.target, retry=t.retrier()) as client:
        assert client.generate("hello").attempts == 1
    assert t.sleeps == []


def test_unavailable_with_retry_info_from_an_open_breaker_is_honoured(admission):
    server = admission(refuse(C.UNAVAILABLE, retry_after=4.0), ANSWER)
    t = FakeTime()
    with Client(server.target, retry=t.retrier()) as client:
        assert client.generate("hello").attempts == 2
    assert t.sleeps == [4.0]


def test_aborted_without_retry_info_backs_off_with_jitter(admission):
    server = admission(refuse(C.ABORTED, retry_after=None), ANSWER)
    t = FakeTime(rand=0.5)
    with Client(server.target, retry=t.retrier(RetryPolicy(base_backoff_s=0.5))) as client:
        assert client.generate("hello").attempts == 2
    assert t.sleeps == [0.25]


def test_retries_stop_at_the_callers_deadline(admission):
    server = admission(refuse(retry_after=1.5))           # refuses forever
    t = FakeTime()
    with Client(server.target, timeout=2.0, retry=t.retrier(RetryPolicy(max_attempts=10))) as client:
        with pytest.raises(ResourceExhausted) as info:
            client.generate("hello")
    # t=0 refused, slept 1.5, t=1.5 refused: another 1.5 s would end past the 2 s deadline, so it stops there
    assert t.sleeps == [1.5] and len(server.servicer.calls) == 2
    assert info.value.attempts == 2 and "past the call's deadline" in info.value.gave_up
    assert info.value.retry_after == 1.5


def test_invalid_argument_is_never_retried(admission):
    server = admission(refuse(C.INVALID_ARGUMENT, retry_after=1.0), ANSWER)
    t = FakeTime()
    with Client(server.target, retry=t.retrier()) as client:
        with pytest.raises(InvalidArgument) as info:
            client.generate("hello")
    assert len(server.servicer.calls) == 1 and t.sleeps == [] and info.value.attempts == 1


def test_resource_exhausted_without_retry_info_is_not_retried(admission):
    server = admission(refuse(C.RESOURCE_EXHAUSTED, retry_after=None), ANSWER)
    t = FakeTime()
    with Client(server.target, retry=t.retrier()) as client:
        with pytest.raises(ResourceExhausted) as info:
            client.generate("hello")
    assert len(server.servicer.calls) == 1 and "without a RetryInfo" in info.value.gave_up


def test_attempts_are_capped_by_the_policy(admission):
    server = admission(refuse(C.UNAVAILABLE, retry_after=0.1))
    t = FakeTime()
    with Client(server.target, retry=t.retrier(RetryPolicy(max_attempts=3))) as client:
        with pytest.raises(Unavailable) as info:
            client.generate("hello")
    assert len(server.servicer.calls) == 3 and len(t.sleeps) == 2
    assert info.value.attempts == 3 and "max_attempts=3" in info.value.gave_up


def test_the_budget_limits_retries_across_calls(admission):
    server = admission(refuse(C.UNAVAILABLE, retry_after=0.1))
    t = FakeTime()
    budget = RetryBudget(ratio=0.0, burst=1.0)             # one retry for this client, ever
    with Client(server.target, retry=t.retrier(RetryPolicy(max_attempts=3), budget)) as client:
        with pytest.raises(Unavailable) as first:
            client.generate("hello")
        with pytest.raises(Unavailable) as second:
            client.generate("hello")
    assert first.value.attempts == 2 and "retry budget is spent" in first.value.gave_up
    assert second.value.attempts == 1 and len(server.servicer.calls) == 3


def test_retry_off_means_one_attempt(admission):
    for retry in (None, False):
        server = admission(refuse(retry_after=0.1), ANSWER)
        with Client(server.target, retry=retry) as client:
            with pytest.raises(ResourceExhausted) as info:
                client.generate("hello")
        assert len(server.servicer.calls) == 1 and info.value.attempts == 1


def test_every_attempts_receipt_is_checked(admission):
    server = admission(refuse(retry_after=0.1), ("bad_receipt",), ANSWER)
    t = FakeTime()
    with Client(server.target, retry=t.retrier()) as client:
        with pytest.raises(ReceiptMismatch, match="another prompt"):
            client.generate("hello")
    assert len(server.servicer.calls) == 2     # a wrong answer is raised, not retried away


def test_a_stream_refused_before_its_first_token_is_retried(admission):
    server = admission(refuse(retry_after=2.0), ANSWER)
    t = FakeTime()
    with Client(server.target, timeout=30, retry=t.retrier()) as client:
        stream = client.stream("hello", request_id="label")
        assert [d.text for d in stream] == ["t0", "t1", "t2"]
    assert stream.attempts == 2 and stream.result.attempts == 2 and stream.result.receipt.request_id == "label"
    assert t.sleeps == [2.0] and server.servicer.sequential()   # the label was free again: no ALREADY_EXISTS


def test_a_stream_that_breaks_after_a_token_was_shown_resumes_where_it_stopped(admission):
    server = admission(("tokens_then", 1, C.UNAVAILABLE), ANSWER)
    t = FakeTime()
    with Client(server.target, retry=t.retrier()) as client:
        stream = client.stream("hello", temperature=0.5)
        seen = [delta.text for delta in stream]
    assert seen == ["t0", "t1", "t2"] and stream.attempts == 2 and len(t.sleeps) == 1
    first, second = server.servicer.calls
    assert first.resume == [] and second.resume == [10]          # what the caller already had, not again
    assert stream.result.token_ids == [10, 11, 12] and stream.result.receipt.output_tokens == 3
    assert server.servicer.sequential()


def test_a_broken_stream_resumes_within_the_retry_budget_only(admission):
    server = admission(("tokens_then", 1, C.UNAVAILABLE))     # breaks after one more token, every time
    t = FakeTime()
    with Client(server.target, retry=t.retrier(RetryPolicy(max_attempts=3))) as client:
        seen = []
        with pytest.raises(Unavailable) as info:
            for delta in client.stream("hello"):
                seen.append(delta.text)
    assert seen == ["t0", "t1", "t2"] and info.value.attempts == 3 and "max_attempts=3" in info.value.gave_up
    assert [c.resume for c in server.servicer.calls] == [[], [10], [10, 11]]


def test_a_broken_stream_resumes_on_the_next_admission(admission):
    a, b = admission(("tokens_then", 2, C.UNAVAILABLE)), admission(ANSWER)
    t = FakeTime()
    with Client(targets=[a.target, b.target], retry=t.retrier()) as client:
        stream = client.stream("hello")
        assert [d.text for d in stream] == ["t0", "t1", "t2"]
    assert len(a.servicer.calls) == 1 and [c.resume for c in b.servicer.calls] == [[10, 11]]


def test_tag_is_retried_too(admission):
    class Tagging(FakeAdmission):
        async def Tag(self, request, context):
            self.calls.append(Call(request.prompt, "", [], self._tick(), self._tick()))
            if len(self.calls) == 1:
                await self._refuse(context, C.RESOURCE_EXHAUSTED, 1.0)
            return admission_pb2.TagResponse(tags=common_pb2.IntentTags(language="en"))
    server = Server(Tagging())
    try:
        t = FakeTime()
        with Client(server.target, retry=t.retrier()) as client:
            assert client.tag("hello")["language"] == "en"
        assert t.sleeps == [1.0]
    finally:
        server.stop()


# ---- the asyncio client ---------------------------------------------------------------------------------------

class AsyncFakeTime(FakeTime):
    async def sleep(self, seconds: float) -> None:     # a coroutine function, as AsyncClient may be given
        super().sleep(seconds)


def test_async_refusals_are_retried_within_the_deadline(admission):
    server = admission(refuse(retry_after=1.5), refuse(retry_after=1.5), ANSWER)
    t = AsyncFakeTime()

    async def run():
        async with AsyncClient(server.target, timeout=30, retry=t.retrier()) as client:
            ok = await client.generate("hello")
        async with AsyncClient(server.target, timeout=2.0, retry=t.retrier(RetryPolicy(max_attempts=10))) as client:
            server.servicer.script[:] = [refuse(retry_after=1.5)]
            with pytest.raises(ResourceExhausted) as info:
                await client.chat([("user", "hello")])
        return ok, info.value
    ok, error = asyncio.run(run())
    assert ok.attempts == 3 and error.attempts == 2 and "past the call's deadline" in error.gave_up
    assert t.sleeps == [1.5, 1.5, 1.5] and len(server.servicer.calls) == 5 and server.servicer.sequential()


def test_async_invalid_argument_is_never_retried(admission):
    server = admission(refuse(C.INVALID_ARGUMENT, retry_after=1.0), ANSWER)
    t = AsyncFakeTime()

    async def run():
        async with AsyncClient(server.target, retry=t.retrier()) as client:
            with pytest.raises(InvalidArgument):
                await client.generate("hello")
    asyncio.run(run())
    assert len(server.servicer.calls) == 1 and t.sleeps == []


def test_async_streams_retry_before_and_resume_after_the_first_token(admission):
    server = admission(refuse(C.UNAVAILABLE, retry_after=0.5), ANSWER)
    t = AsyncFakeTime()

    async def run():
        async with AsyncClient(server.target, timeout=30, retry=t.retrier()) as client:
            stream = client.stream("hello")
            texts = [d.text async for d in stream]
            server.servicer.script[:] = [("tokens_then", 2, C.ABORTED), ANSWER]
            server.servicer.calls.clear()
            late = client.stream("hello")
            seen = [d.text async for d in late]
        return stream, texts, late, seen
    stream, texts, late, seen = asyncio.run(run())
    assert texts == ["t0", "t1", "t2"] and stream.attempts == 2 and stream.result.attempts == 2
    assert seen == ["t0", "t1", "t2"] and late.attempts == 2 and late.result.token_ids == [10, 11, 12]
    assert [c.resume for c in server.servicer.calls] == [[], [10, 11]] and server.servicer.sequential()


# ---- the CLI: `--retries N` on `tether generate` and `tether chat` --------------------------------------------

def test_retries_flag_defaults_to_the_sdk_default_and_zero_disables():
    assert generate.build_parser().parse_args(["x"]).retries == 2
    assert chat.build_parser().parse_args([]).retries == 2
    assert generate.retry_policy(2).max_attempts == 3
    assert generate.retry_policy(0) is None
    assert chat.build_parser().parse_args(["--retries", "0"]).retries == 0


@pytest.mark.parametrize("bad,match", [("-1", "cannot be negative"), ("two", "whole number")])
def test_a_bad_retries_value_is_a_usage_error_that_says_why(bad, match, capsys):
    with pytest.raises(SystemExit):
        generate.build_parser().parse_args(["x", "--retries", bad])
    assert match in capsys.readouterr().err


def test_error_text_says_why_no_more_attempts_were_made():
    e = ResourceExhausted("busy", retry_after=1.0)
    e.attempts, e.gave_up = 3, "gave up after 3 attempts (max_attempts=3)"
    assert generate.error_text(e, True) == "RESOURCE_EXHAUSTED: busy (gave up after 3 attempts (max_attempts=3))"
    plain = ResourceExhausted("busy")
    plain.gave_up = "gave up after 1 attempt (max_attempts=1)"
    assert generate.error_text(plain, False) == "RESOURCE_EXHAUSTED: busy"   # --retries 0: nothing to explain


def test_generate_retries_a_refusal_and_zero_retries_does_not(admission, capsys):
    server = admission(refuse(retry_after=0.01), ANSWER)
    generate.main(["hello", "--target", server.target, "--retries", "1"])
    assert capsys.readouterr().out == "ok\n" and len(server.servicer.calls) == 2

    server = admission(refuse(retry_after=0.01), ANSWER)
    with pytest.raises(SystemExit, match="RESOURCE_EXHAUSTED: scripted refusal 1") as info:
        generate.main(["hello", "--target", server.target, "--retries", "0"])
    assert "attempt" not in str(info.value) and len(server.servicer.calls) == 1


def test_chat_reports_a_reply_that_kept_failing_after_its_first_token(admission):
    server = admission(("tokens_then", 1, C.UNAVAILABLE))
    err = io.StringIO()
    with Client(server.target, retry=generate.retry_policy(2)) as client:
        chat.repl(client, chat.Conversation(), {}, io.StringIO("hi\n"), io.StringIO(), err, interactive=False)
    assert "gave up after 3 attempts" in err.getvalue() and len(server.servicer.calls) == 3


# ---- cancelling a stream while it waits to retry ---------------------------------------------------------------

def test_cancel_cuts_a_streams_retry_wait_short(admission):
    """The real sleep (no injection): a 60 s RetryInfo wait ends as soon as cancel() is called."""
    server = admission(refuse(retry_after=60.0), ANSWER)
    with Client(server.target, retry=RetryPolicy(max_wait_s=120)) as client:
        stream = client.stream("hello")
        outcome = []

        def consume():
            try:
                list(stream)
            except Exception as e:   # noqa: BLE001 - the test inspects it
                outcome.append(e)
        t = threading.Thread(target=consume)
        t.start()
        for _ in range(2000):       # until the first attempt was refused (at most 20 s)
            if server.servicer.calls and server.servicer.calls[0].ended >= 0:
                break
            threading.Event().wait(0.01)
        stream.cancel()             # before or during the wait: Event.wait returns at once either way
        t.join(20)
    assert not t.is_alive(), "cancel() did not end the retry wait"
    assert outcome and outcome[0].code in (C.CANCELLED, C.RESOURCE_EXHAUSTED)
    assert len(server.servicer.calls) == 1     # no second attempt after the cancel


async def _cancel_once(target: str, started) -> tuple[BaseException, bool]:
    """An AsyncClient stream cancelled once `started()` holds: what its consumer raised, and whether the consuming
    task ended cancelled."""
    async with AsyncClient(target, retry=RetryPolicy(max_wait_s=120)) as client:
        stream = client.stream("hello")

        async def consume():
            return [d async for d in stream]
        task = asyncio.create_task(consume())
        while not started():
            await asyncio.sleep(0.01)
        stream.cancel()
        try:
            await asyncio.wait_for(task, 20)
        except BaseException as e:   # noqa: BLE001 - the tests inspect it (a CancelledError included)
            return e, task.cancelled()
        raise AssertionError("the stream ended without an error")


def test_async_cancel_cuts_a_streams_retry_wait_short(admission):
    server = admission(refuse(retry_after=60.0), ANSWER)
    calls = server.servicer.calls
    error, _ = asyncio.run(_cancel_once(server.target, lambda: calls and calls[0].ended >= 0))   # first refused
    assert isinstance(error, Exception) and not isinstance(error, asyncio.TimeoutError), \
        f"cancel() did not end the retry wait: {error!r}"
    assert len(server.servicer.calls) == 1


def test_async_cancel_of_a_stream_still_starting_raises_cancelled_not_a_cancelled_task(admission):
    """cancel() before the server sent anything: grpc.aio raises CancelledError from inside the call; the consumer
    gets a TetherError CANCELLED like any cancel, and its task does not end up looking cancelled."""
    server = admission(("hold", 30.0))
    calls = server.servicer.calls
    error, cancelled = asyncio.run(_cancel_once(server.target, lambda: bool(calls)))   # held without a byte
    assert isinstance(error, TetherError) and error.code == C.CANCELLED and not cancelled, repr(error)
