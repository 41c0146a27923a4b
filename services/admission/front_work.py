"""The CPU work of admitting a request: render a conversation, tokenize, validate and tag.

Where it runs matters more than what it costs. Python's `re` holds the GIL for a whole scan, so tagging
prompts at the cap on threads starved admission's event loop: with 8 clients sending 4 KB prompts, a small
request waited 2.2x its idle latency (bench/front_door.py). Large requests therefore go to worker processes
that each hold the model's tokenizer and chat template; a small one (under TAG_INLINE_BYTES) is cheaper to do
at once than to ship, and never queues behind the large ones.

The pool never queues: at most one job per worker is submitted, and the jobs waiting for a worker wait here,
one queue per tenant account, taken round robin (WorkQueue), so a tenant flooding admission with large prompts
delays another's by about one job, not by its whole backlog. Waiting is overload, never the prompt's fault: a
full queue, or a job not started within TAG_QUEUE_WAIT_S, raises Busy (RESOURCE_EXHAUSTED + RetryInfo at the
door), and the time budget (TimeoutError: INVALID_ARGUMENT, "send a shorter prompt") counts from the job's
start on a worker. A job past its budget still holds its worker until it ends (a process pool cannot stop it),
so no other job is submitted to a worker that is still busy.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import cast

from services.admission.tagger import Tags, classify_size, tag, tag_conversation
from services.admission.validate import ModelLimits, ValidRequest, check_resume_budget, validate
from tether import settings
from tether.model.chat_template import load_chat_template
from tether.model.config import ModelConfig
from tether.model.tokenizer import load_tokenizer
from tether.procutil import die_with
from tether.telemetry import logs
from tether.v1 import admission_pb2

log = logging.getLogger(__name__)

_worker_limits: ModelLimits | None = None   # set in each worker process by `_init_worker`


def model_limits(folder: str | Path) -> ModelLimits:
    """Tokenizer, context, vocabulary and chat template of the model in `folder` (no torch needed)."""
    cfg = ModelConfig.from_folder(folder)
    return ModelLimits(load_tokenizer(folder, cfg.eos_token_ids, cfg.bos_token_id), cfg.max_position_embeddings,
                       cfg.vocab_size, load_chat_template(folder))


def request_bytes(request: admission_pb2.GenerateRequest) -> int:
    return len(request.prompt) + sum(len(m.content) for m in request.messages)


# Characters of the last user message whose tokens estimate a conversation's tokens per character: a sample
# bounds the extra tokenizing however long the message.
RATIO_SAMPLE_CHARS = 2000


def answer_tokens_per_char(valid: ValidRequest, limits: ModelLimits) -> float:
    """The tokenizer's tokens per character in the answer's language, which turns a "不超过50字" limit into tokens:
    measured on a raw prompt itself, and on a conversation's last user message (the answer follows its
    language), not on the rendered conversation, whose chat template and system turn (often English) would
    set it: on SmolLM2 a Chinese message is 1.7 tokens a character where its rendered conversation is 0.4, so
    a "50 字" answer was cut at ~22 characters."""
    users = [content for role, content in valid.messages if role == "user" and content.strip()]
    if not users:
        return len(valid.prompt_token_ids) / len(valid.prompt)
    sample = users[-1][:RATIO_SAMPLE_CHARS]
    return max(1, len(limits.tokenizer.encode(sample))) / len(sample)


def admit(request: admission_pb2.GenerateRequest, limits: ModelLimits) -> tuple[ValidRequest, Tags]:
    """Validate and tag one request (raises ValidationError / ConversationError, both ValueErrors)."""
    valid = validate(request, limits)
    tokens_per_char = answer_tokens_per_char(valid, limits)
    try:
        sizes = (len(valid.prompt_token_ids), valid.sampling.max_tokens)
        if valid.messages:   # its structure is given by the messages: tag that, not the rendered text
            tags = tag_conversation(valid.messages, *sizes, tenant=valid.tenant, priority=valid.priority,
                                    tokens_per_char=tokens_per_char)
        else:
            tags = tag(valid.prompt, *sizes, tenant=valid.tenant, priority=valid.priority,
                       tokens_per_char=tokens_per_char)
    except Exception:   # noqa: BLE001 - a tagger bug must not cost the request: serve it untagged
        log.exception("tagger failed; serving the request with empty tags")
        tags = untagged(valid)
    check_resume_budget(valid, tags.output_budget)
    return valid, tags


def untagged(valid: ValidRequest) -> Tags:
    """Tags with every intent dimension left empty: what a request gets if the tagger itself fails."""
    budget = valid.sampling.max_tokens
    return Tags(input_tokens=len(valid.prompt_token_ids), language="", length_limit=0, length_unit="",
                output_budget=budget, task="", size_class=classify_size(budget), domain="", audience="",
                priority=valid.priority, tenant=valid.tenant, turns=1, prefix_key=0)


def _init_worker(folder: str, parent: int, log_config: tuple[str, str, str] | None = None) -> None:
    global _worker_limits
    die_with(parent, "admission exited before its worker started")   # a killed admission leaves no workers
    if log_config is not None:   # a spawned worker starts unconfigured: log as admission does (json or text)
        logs.configure(*log_config)
    _worker_limits = model_limits(folder)


def _ready() -> bool:
    return _worker_limits is not None


def _admit_in_worker(request: admission_pb2.GenerateRequest) -> tuple[ValidRequest, Tags]:
    assert _worker_limits is not None, "worker not initialised"
    return admit(request, _worker_limits)


class Busy(Exception):
    """No worker took the job in time, or the queue is full: overload, for the caller to retry."""

    def __init__(self, message: str, retry_after_s: float = settings.OVERLOAD_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class WorkQueue:
    """The jobs waiting for a worker, one FIFO per account, served round robin (pure; not thread-safe)."""

    def __init__(self, per_account: int = settings.TAG_QUEUE_PER_TENANT,
                 max_waiting: int = settings.TAG_QUEUE_MAX) -> None:
        self.per_account, self.max_waiting = per_account, max_waiting
        self.by_account: dict[str, deque] = {}   # insertion order is the round: the next account is the first
        self.waiting = 0

    def push(self, account: str, job: object) -> str | None:
        """Queue `job`, or say why not (the refusal's message)."""
        mine = self.by_account.get(account)
        if mine is not None and len(mine) >= self.per_account:
            return (f"this tenant already has {len(mine)} requests waiting for admission's tokenizer workers; "
                    f"retry in {settings.OVERLOAD_RETRY_AFTER_S:g} s")
        if self.waiting >= self.max_waiting:
            return (f"admission's tokenizer workers have {self.waiting} requests waiting; "
                    f"retry in {settings.OVERLOAD_RETRY_AFTER_S:g} s")
        self.by_account.setdefault(account, deque()).append(job)
        self.waiting += 1
        return None

    def pop(self) -> object | None:
        """The next job: the first account's oldest; that account goes to the end of the round."""
        if not self.by_account:
            return None
        account = next(iter(self.by_account))
        mine = self.by_account.pop(account)
        job = mine.popleft()
        if mine:
            self.by_account[account] = mine
        self.waiting -= 1
        return job

    def remove(self, account: str, job: object) -> bool:
        """Take back a job that gave up waiting; False when it is no longer waiting (it was popped)."""
        mine = self.by_account.get(account)
        if mine is None or job not in mine:
            return False
        mine.remove(job)
        if not mine:
            del self.by_account[account]
        self.waiting -= 1
        return True


class FrontWork:
    """Runs `admit` inline for small requests, in a process pool for large ones (one job per worker at a time;
    the rest wait in a WorkQueue)."""

    def __init__(self, folder: str | Path, limits: ModelLimits, workers: int = settings.TAG_WORKERS,
                 inline_bytes: int = settings.TAG_INLINE_BYTES, queue: WorkQueue | None = None,
                 queue_wait_s: float = settings.TAG_QUEUE_WAIT_S) -> None:
        self.limits = limits
        self.inline_bytes = inline_bytes
        self.folder, self.workers = str(folder), workers
        self.pool = self._new_pool()
        self.queue = queue or WorkQueue()
        self.queue_wait_s = queue_wait_s
        # Jobs on a worker: changed from the event loop and from the pool's thread that completes jobs.
        self.busy = 0
        self._lock = threading.Lock()

    def _new_pool(self) -> ProcessPoolExecutor | None:
        if not self.workers:
            return None
        # spawn, not fork: admission is a threaded gRPC process, and a forked copy of its locks can deadlock.
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_init_worker, initargs=(self.folder, os.getpid(), logs.current()))

    def restart(self, broken: ProcessPoolExecutor) -> None:
        """A worker of `broken` died (that pool is unusable for good): start a new pool, once, from the event
        loop's thread (the new workers' parent-death signal follows it)."""
        if self.pool is not broken:
            return   # another request already replaced it
        self.pool = self._new_pool()
        broken.shutdown(wait=False, cancel_futures=True)
        log.error("a front-door worker process died; started a new pool")

    def warm_up(self, timeout_s: float = 120.0) -> None:
        """Start the worker processes now (spawning and loading the tokenizer takes seconds): the first large
        request must not pay it against its time budget. Call it from the main thread: the workers' parent-
        death signal follows the thread that spawned them."""
        if self.pool is not None:
            for f in [self.pool.submit(_ready) for _ in range(self.workers)]:
                assert f.result(timeout=timeout_s)

    def is_inline(self, request: admission_pb2.GenerateRequest) -> bool:
        return self.pool is None or request_bytes(request) <= self.inline_bytes

    async def run(self, request: admission_pb2.GenerateRequest, timeout_s: float,
                  account: str = "") -> tuple[ValidRequest, Tags]:
        """`admit` in a worker process within `timeout_s` of its start there (TimeoutError past it), after its
        turn among `account`'s and other accounts' waiting jobs (Busy when it gets none); a dead worker restarts
        the pool and raises BrokenProcessPool for this request."""
        pool = self.pool
        assert pool is not None, "run() is for pooled work (is_inline() is True without a pool)"
        await self._turn(account)
        pool = self.pool or pool   # restarted while this job waited: the new one
        try:
            job = pool.submit(_admit_in_worker, request)
        except BaseException as e:
            self._finished()
            if isinstance(e, BrokenProcessPool):
                self.restart(pool)
            raise
        # The worker is free when the job ends, not when the caller stops waiting for it.
        job.add_done_callback(lambda _: self._finished())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), timeout_s)
        except BrokenProcessPool:
            self.restart(pool)
            raise

    async def _turn(self, account: str) -> None:
        """Return holding a worker of our own (counted in `busy`), or raise Busy."""
        with self._lock:
            if self.busy < self.workers and not self.queue.waiting:
                self.busy += 1
                return
            ticket: asyncio.Future = asyncio.get_running_loop().create_future()
            refusal = self.queue.push(account, ticket)
        if refusal is not None:
            raise Busy(refusal)
        try:
            await asyncio.wait_for(ticket, self.queue_wait_s)
        except BaseException as e:
            with self._lock:
                waiting = self.queue.remove(account, ticket)
            if not waiting and ticket.done() and not ticket.cancelled():
                self._finished()   # granted just as it gave up: the worker goes to the next job
            if isinstance(e, TimeoutError):
                raise Busy(f"no tokenizer worker of admission was free within {self.queue_wait_s:g} s (other "
                           f"requests ahead); retry in {settings.OVERLOAD_RETRY_AFTER_S:g} s") from None
            raise

    def _finished(self) -> None:
        """A worker is free (any thread): give it to the next waiting job."""
        with self._lock:
            self.busy -= 1
            granted: list[asyncio.Future] = []
            while self.busy < self.workers and (ticket := self.queue.pop()) is not None:
                self.busy += 1
                granted.append(cast(asyncio.Future, ticket))
        for ticket in granted:
            try:
                ticket.get_loop().call_soon_threadsafe(self._grant, ticket)
            except RuntimeError:   # its loop is closed: that waiter is gone
                self._finished()

    def _grant(self, ticket: asyncio.Future) -> None:
        if ticket.done():          # its waiter gave up (cancelled) after it was taken from the queue
            self._finished()
        else:
            ticket.set_result(None)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
