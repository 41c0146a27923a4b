"""Continuous batching for one pipeline (pure logic: no gRPC, no asyncio).

The coordinator is the single writer of each request's sequence. A request has at most one frame in
flight; new requests join at any step boundary; up to S micro-batches (one per stage) are kept in flight.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from tether.engine.sequence import Sequence
from tether.protocol.hashing import ContextHasher, sampling_digest
from tether.v1 import stage_pb2

PRIORITY_ORDER = {"critical": 0, "standard": 1, "sheddable": 2}


@dataclass
class Request:
    seq: Sequence
    tenant: str = ""
    priority: str = "standard"
    epoch: int = 1
    fed: int = 0                       # context tokens the stages hold, confirmed by an echoed stamp
    fed_hash: ContextHasher = None     # type: ignore[assignment]  # chain over those tokens
    in_flight: bool = False
    retries: int = 0                   # rebuilds so far
    resumes: int = 0                   # resumes after a sync so far (they count against the same budget)
    done: bool = False                 # finished, failed or cancelled: never scheduled again
    sent: stage_pb2.Stamp | None = None   # the stamp of the frame in flight

    def __post_init__(self) -> None:
        if self.fed_hash is None:
            self.fed_hash = ContextHasher(self.seq.hash_seed)
        self.sampling_digest = sampling_digest(self.seq.sampling)

    @property
    def resumed(self) -> bool:
        return self.resumes > 0

    @property
    def recoveries(self) -> int:
        """Rebuilds and resumes so far: both count against the request's recovery budget."""
        return self.retries + self.resumes

    @property
    def id(self) -> str:
        return self.seq.request_id

    @property
    def pending(self) -> int:
        """Context tokens the stages do not hold yet."""
        return len(self.seq.all_ids) - self.fed

    def stamp(self, limit: int | None = None) -> stage_pb2.Stamp:
        """The stamp for the next frame: the next `limit` context tokens the stages do not hold (all by
        default). A stamp that stops short of the end is a prefill chunk: no token is sampled after it."""
        ids = self.seq.all_ids[self.fed:self.fed + limit] if limit else self.seq.all_ids[self.fed:]
        return stage_pb2.Stamp(request_id=self.id, epoch=self.epoch, position=self.fed, token_ids=ids,
                               parent_hash=self.fed_hash.value, context_hash=self.fed_hash.peek(ids),
                               sampling_digest=self.sampling_digest)

    @property
    def samples(self) -> bool:
        """Whether the frame in flight reaches the end of the context (so a token comes back)."""
        return self.sent is not None and self.sent.position + len(self.sent.token_ids) == len(self.seq.all_ids)

    def echo_matches(self, echo: stage_pb2.Stamp) -> bool:
        s = self.sent
        return (s is not None and echo.request_id == s.request_id and echo.epoch == s.epoch
                and echo.position == s.position and echo.parent_hash == s.parent_hash
                and echo.context_hash == s.context_hash and echo.sampling_digest == s.sampling_digest)

    def confirm(self) -> None:
        """The frame in flight was processed by every stage: they now hold what it carried."""
        self.fed_hash.extend(self.sent.token_ids)
        self.fed = self.fed_hash.length
        self.sent = None
        self.in_flight = False

    def rebuild(self) -> None:
        """Start this request's state over under a new epoch: the whole context is replayed."""
        self.epoch += 1
        self.fed = 0
        self.fed_hash = ContextHasher(self.seq.hash_seed)
        self.sent = None
        self.in_flight = False
        self.retries += 1


@dataclass
class Scheduler:
    num_stages: int
    max_slots: int
    max_tokens: int
    waiting: deque[Request] = field(default_factory=deque)
    running: dict[str, Request] = field(default_factory=dict)
    frames_in_flight: int = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        req.done = True
        self.running.pop(req.id, None)
        try:
            self.waiting.remove(req)
        except ValueError:
            pass

    def has_room(self) -> bool:
        return self.frames_in_flight < self.num_stages

    def next_batch(self) -> list[Request]:
        """Requests for the next micro-batch, each marked in flight with the stamp it is sent with.

        The batch takes an even share of the active requests so that S micro-batches keep S stages busy;
        running requests go first, then waiting ones by priority and arrival. At most `max_tokens` rows go
        in one frame: a prompt that does not fit is prefilled in chunks (batch invariance makes chunking
        invisible in the output), so long prompts never stall the decodes batched with them; while requests
        wait, a chunk takes at most half the rows, so a long prompt never stalls a short one behind it either.
        """
        if not self.has_room():
            return []
        active = len(self.running) + len(self.waiting)
        share = min(self.max_slots, max(1, math.ceil(active / self.num_stages)))
        batch: list[tuple[Request, int]] = []
        tokens = 0
        # Running requests first, in order (none of them can starve). While requests wait, running prefill
        # chunks take at most half the frame's rows (decodes always fit), so long prompts never hold every
        # frame while a short request waits to start.
        prefill_rows = self.max_tokens - (self.max_tokens // 2 if self.waiting else 0)
        for req in self.running.values():
            if len(batch) >= share or tokens >= self.max_tokens:
                break
            if req.in_flight or req.done:
                continue
            n = min(req.pending, self.max_tokens - tokens)
            if n > 1:
                n = min(n, prefill_rows - tokens)
                if n < 1:
                    continue
            batch.append((req, n))
            tokens += n
        if self.waiting:
            ordered = sorted(self.waiting, key=lambda r: PRIORITY_ORDER.get(r.priority, 1))  # stable: FIFO within
            for req in ordered:
                if len(batch) >= share or tokens >= self.max_tokens:
                    break
                n = min(req.pending, self.max_tokens - tokens)
                self.waiting.remove(req)
                self.running[req.id] = req
                batch.append((req, n))
                tokens += n
        for req, n in batch:
            req.in_flight = True
            req.sent = req.stamp(n)
        if batch:
            self.frames_in_flight += 1
        return [req for req, _ in batch]

    def frame_done(self) -> None:
        self.frames_in_flight -= 1
