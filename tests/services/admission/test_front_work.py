"""Admission's CPU work in worker processes (services/admission/front_work.py): the same answers as inline,
errors that stay ValueErrors across the process boundary, and a dead worker replaced, not a broken door."""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures.process import BrokenProcessPool

import pytest

from services.admission.front_work import FrontWork, admit, model_limits
from tether.model.loader import resolve_model
from tether.v1 import admission_pb2, common_pb2


@pytest.fixture(scope="module")
def work():
    folder = resolve_model("tiny")
    w = FrontWork(folder, model_limits(folder), workers=1, inline_bytes=64)
    w.warm_up()
    yield w
    w.close()


def req(prompt: str, max_tokens: int = 400) -> admission_pb2.GenerateRequest:
    return admission_pb2.GenerateRequest(prompt=prompt.encode(), sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens))


def test_large_requests_go_to_a_worker_and_give_what_inline_gives(work):
    small, large = req("请用不超过50字向老人解释血糖仪读数"), req("Summarize in under 40 words: " + "lorem ipsum " * 300)
    assert work.is_inline(req("hi")) and not work.is_inline(large)
    for r in (small, large):
        remote = asyncio.run(work.run(r, 30))
        local = admit(r, work.limits)
        assert remote[1] == local[1] and remote[0].prompt_token_ids == local[0].prompt_token_ids
    assert asyncio.run(work.run(large, 30))[1].length_limit == 40


def test_a_refusal_in_a_worker_is_still_a_value_error_with_its_message(work):
    with pytest.raises(ValueError, match="max_tokens"):
        asyncio.run(work.run(req("x" * 200, max_tokens=100_000), 30))


def test_a_dead_worker_fails_its_request_and_the_next_one_is_served(work):
    pid = asyncio.run(_worker_pid(work))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(BrokenProcessPool):
        asyncio.run(work.run(req("y" * 200), 30))
    work.warm_up()
    assert asyncio.run(work.run(req("y" * 200), 30))[0].prompt_token_ids


async def _worker_pid(work: FrontWork) -> int:
    return await asyncio.wrap_future(work.pool.submit(os.getpid))
