"""Admission's CPU work in worker processes (services/admission/front_work.py): the same answers as inline,
errors that stay ValueErrors across the process boundary, and a dead worker replaced, not a broken door."""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures.process import BrokenProcessPool

import pytest

from services.admission.front_work import Busy, FrontWork, WorkQueue, admit, model_limits
from services.admission.tagger import implied_budget
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


def test_a_conversations_character_limit_is_counted_in_its_last_user_messages_tokens():
    # SmolLM2's chat template renders an English system turn around the message: its rendered text runs ~0.4
    # tokens a character where the Chinese message runs 1.7, and the budget once followed the rendered text (36
    # tokens, ~22 of the 50 characters asked for)
    limits = model_limits(resolve_model("smollm2"))
    ask = "请用不超过50字向老人解释血糖仪读数"
    chat = admission_pb2.GenerateRequest(messages=[admission_pb2.Message(role="user", content=ask.encode())],
                                         sampling=common_pb2.SamplingParams(max_tokens=1000))
    valid, tags = admit(chat, limits)
    per_char = len(limits.tokenizer.encode(ask)) / len(ask)
    assert len(valid.prompt_token_ids) / len(valid.prompt) < per_char / 3          # what the old ratio read
    assert (tags.length_limit, tags.length_unit) == (50, "chars")
    assert tags.output_budget == implied_budget(50, "chars", per_char) >= 50 * per_char
    # a raw prompt is its own sample, as before
    raw_valid, raw = admit(req(ask, 1000), limits)
    assert raw.output_budget == implied_budget(50, "chars", len(raw_valid.prompt_token_ids) / len(ask))


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


# ---- the workers' queue: one job per worker, the rest waiting round robin by tenant account -----------------

def test_the_queue_serves_accounts_round_robin_and_bounds_each():
    q = WorkQueue(per_account=3, max_waiting=5)
    assert [q.push("flood", f"f{i}") for i in range(3)] == [None] * 3
    assert "already has 3 requests waiting" in q.push("flood", "f3")
    assert q.push("other", "o0") is None and q.push("third", "t0") is None
    assert "have 5 requests waiting" in q.push("fourth", "x")
    assert [q.pop() for _ in range(5)] == ["f0", "o0", "t0", "f1", "f2"]
    assert q.pop() is None and q.waiting == 0
    q.push("a", "a0")
    assert q.remove("a", "a0") and not q.remove("a", "a0") and q.by_account == {}


async def _hold_the_worker(work: FrontWork) -> None:
    await work._turn("holder")   # as a job on the only worker would


def test_waiting_for_a_worker_is_not_counted_in_the_budget(work):
    """Jobs queued behind a busy worker for longer than their budget are still served, in round-robin order:
    the flooding account's four jobs do not hold the other account's one back more than one job."""
    async def scenario():
        await _hold_the_worker(work)
        done: list[str] = []

        async def one(account: str, name: str):
            await work.run(req(f"{name} " * 60), 1.0, account)
            done.append(name)

        tasks = []
        for account, name in [("flood", "f1"), ("flood", "f2"), ("flood", "f3"), ("flood", "f4"), ("other", "o1")]:
            tasks.append(asyncio.create_task(one(account, name)))
            await asyncio.sleep(0)                    # each task reaches the queue in this order
        assert work.queue.waiting == 5
        await asyncio.sleep(1.5)                      # the worker stays busy past every job's budget
        work._finished()                              # ... then frees
        await asyncio.gather(*tasks)
        return done

    assert asyncio.run(scenario()) == ["f1", "o1", "f2", "f3", "f4"]
    assert work.busy == 0 and work.queue.waiting == 0


def test_a_job_that_finds_no_worker_in_time_or_no_room_is_busy_not_invalid(work, monkeypatch):
    monkeypatch.setattr(work, "queue_wait_s", 0.3)
    monkeypatch.setattr(work, "queue", WorkQueue(per_account=1, max_waiting=8))

    async def scenario():
        await _hold_the_worker(work)
        waiting = asyncio.create_task(work.run(req("z" * 200), 30, "flood"))
        await asyncio.sleep(0)
        with pytest.raises(Busy, match="already has 1 requests waiting"):   # its second: refused at once
            await work.run(req("z" * 200), 30, "flood")
        with pytest.raises(Busy, match="no tokenizer worker of admission was free within 0.3 s") as e:
            await waiting
        assert e.value.retry_after_s > 0
        work._finished()

    asyncio.run(scenario())
    assert work.busy == 0 and work.queue.waiting == 0
    assert asyncio.run(work.run(req("z" * 200), 30, "flood"))[0].prompt_token_ids   # the worker is free again
