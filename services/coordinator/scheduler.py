"""Continuous batching for one pipeline (pure logic: no gRPC, no asyncio).

The coordinator is the single writer of each request's sequence. A request has at most one frame in
flight; new requests join at any step boundary; up to S micro-batches (one per stage) are kept in flight, or
one alone while few requests are active and the stages run a micro-batch alone on every core (`alone_max`).

KV-aware (services/coordinator/ledger.py): a request enters the running set only when its whole context fits
in every stage's pool, starting from the longest prefix the stages have cached; when decode growth runs out
of blocks, the lowest-priority, youngest request is preempted (its blocks released, its context recomputed
later, exactly, by batch invariance) instead of a stage refusing it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from services.coordinator.ledger import BlockLedger
from tether.kv.blocks import NO_HIT, extend_by_blocks
from tether.generation.sequence import Sequence
from tether import settings
from tether.mathutil import ceil_div
from tether.priority import Priority
from tether.protocol.hashing import ContextHasher, sampling_digest
from tether.v1 import stage_pb2


class Phase(Enum):
    """Where a request is in its life on this pipeline (one at a time; the transitions are Request's methods).

    ```
    WAITING ──start──▶ SETTLED ──send──▶ IN_FLIGHT ──frame_over──▶ SETTLED
       ▲                  │  ▲               │
       │ released      preempt └─resynced─ SYNCING ◀──lose──┘
       │                  ▼
       └──────────── PREEMPTED                          (its Release under way: not schedulable)

    end():  WAITING, PREEMPTED ──▶ DONE               (nothing of it on the stages, or already being released)
            SETTLED, SYNCING  ──▶ RELEASING ──released──▶ DONE
            IN_FLIGHT ──▶ ENDING ──frame_over / lose──▶ RELEASING      (ended while in flight: release it then)
    ```
    """

    WAITING = "waiting"          # queued to start (or to start again after a preemption)
    PREEMPTED = "preempted"      # queued, its blocks' Release not answered yet: nobody behind it starts first
    SETTLED = "settled"          # running, no frame in flight: schedulable
    IN_FLIGHT = "in flight"      # running, its frame is out (`sent` is its stamp)
    SYNCING = "syncing"          # its frame was given up on; every stage is asked what it holds
    ENDING = "ending"            # ended (finished, failed, cancelled) while its frame was in flight
    RELEASING = "releasing"      # ended; its Release to every stage is queued or under way
    DONE = "done"                # ended, nothing of it left on the stages (or left to their leases)


class PhaseError(AssertionError):
    """A transition from a phase it does not leave: a bug in the driver, never a peer's doing."""


@dataclass(eq=False)   # identity: two requests are never the same request
class Request:
    seq: Sequence
    tenant: str = ""
    priority: Priority = Priority.STANDARD
    epoch: int = 1
    fed: int = 0                       # context tokens the stages hold, confirmed by an echoed stamp
    fed_hash: ContextHasher = None     # type: ignore[assignment]  # chain over those tokens
    phase: Phase = Phase.WAITING
    retries: int = 0                   # rebuilds so far
    resumes: int = 0                   # resumes after a sync so far (they count against the same budget)
    sent: stage_pb2.Stamp | None = None   # the stamp of the frame in flight (kept until its verdict is applied)
    cached: int = 0                    # leading tokens of `sent` the stages take from their prefix cache
    arrival: int = 0                   # order of submission (preemption takes the youngest first)
    queued_at: int = 0                 # the scheduler's step when it last started waiting (priority aging)
    no_prefix: bool = False            # replay cold: a rebuild, or a cached prefix a stage could not confirm
    preempted: bool = False            # waiting again after a preemption (until it starts: Stats' `preempted`)

    # --- the phase machine (see Phase) ---------------------------------------------------------------
    def _move(self, allowed: tuple[Phase, ...], to: Phase, what: str) -> None:
        if self.phase not in allowed:
            raise PhaseError(f"request {self.id}: {what} while {self.phase.value}")
        self.phase = to

    def start(self) -> None:
        """It enters the running set."""
        self._move((Phase.WAITING,), Phase.SETTLED, "start")
        self.preempted = False

    def send(self, stamp: stage_pb2.Stamp, cached: int) -> None:
        """Its next frame goes out with `stamp`."""
        self._move((Phase.SETTLED,), Phase.IN_FLIGHT, "send")
        self.sent, self.cached = stamp, cached

    def frame_over(self) -> bool:
        """Its frame is over: answered (the verdict is applied next, from `sent`) or forgotten with the stream.
        True when it had ended meanwhile: its Release must be queued now (the one place of that rule)."""
        if self.phase is Phase.ENDING:
            self.phase = Phase.RELEASING
            return True
        self._move((Phase.IN_FLIGHT,), Phase.SETTLED, "frame over")
        return False

    def lose(self) -> bool:
        """Its frame went unanswered too long: it waits for a sync. True as for `frame_over`."""
        if self.phase is Phase.ENDING:
            self.phase = Phase.RELEASING
            return True
        self._move((Phase.IN_FLIGHT,), Phase.SYNCING, "lose its frame")
        return False

    def resynced(self) -> None:
        """A sync (or a reconnect) decided how it goes on: resend, resume or rebuild; schedulable again."""
        self._move((Phase.SYNCING, Phase.SETTLED), Phase.SETTLED, "resync")

    def preempt(self) -> None:
        """Its blocks are taken back: it waits (for the Release, then for room) to be recomputed."""
        self._move((Phase.SETTLED,), Phase.PREEMPTED, "preempt")
        self.preempted = True

    def end(self) -> bool:
        """Finished, failed or cancelled: never scheduled again. True when its Release must be queued now
        (it holds state on the stages and no frame of it is out). Ending an ended request changes nothing."""
        if self.done:
            return False
        if self.phase in (Phase.WAITING, Phase.PREEMPTED):
            self.phase = Phase.DONE
            return False
        if self.phase is Phase.IN_FLIGHT:
            self.phase = Phase.ENDING
            return False
        self._move((Phase.SETTLED, Phase.SYNCING), Phase.RELEASING, "end")
        return True

    def released(self) -> None:
        """Every stage answered its Release (or the stages' leases are left to free it)."""
        if self.phase is Phase.PREEMPTED:
            self.phase = Phase.WAITING
        elif self.phase is Phase.RELEASING:
            self.phase = Phase.DONE

    @property
    def in_flight(self) -> bool:
        """A frame of it is out or unaccounted for: it is not schedulable, and not releasable yet."""
        return self.phase in (Phase.IN_FLIGHT, Phase.SYNCING, Phase.ENDING)

    @property
    def done(self) -> bool:
        """Ended: never scheduled again."""
        return self.phase in (Phase.ENDING, Phase.RELEASING, Phase.DONE)

    @property
    def releasing(self) -> bool:
        """Preempted, and its Release not answered yet: not schedulable."""
        return self.phase is Phase.PREEMPTED

    def __post_init__(self) -> None:
        if self.fed_hash is None:
            self.fed_hash = ContextHasher(self.seq.hash_seed)
        self.sampling_digest = sampling_digest(self.seq.sampling)
        self.block_ends: list[int] = []   # the confirmed chain's value at each full block's end (the ledger's keys)

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

    def stamp(self, limit: int | None = None, cached: int = 0) -> stage_pb2.Stamp:
        """The stamp for the next frame: the next `limit` context tokens the stages do not hold (all by
        default), after `cached` tokens the stages take from their prefix cache. A stamp that stops short of
        the end is a prefill chunk: no token is sampled after it."""
        ids = self.seq.all_ids[self.fed:self.fed + cached + limit] if limit else self.seq.all_ids[self.fed:]
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

    def confirm(self, block: int = 0) -> None:
        """The frame in flight was processed by every stage: they now hold what it carried. With `block`,
        note the chain's value at each block end it crossed."""
        assert self.sent is not None   # a frame is in flight
        if block:
            self.block_ends += extend_by_blocks(self.fed_hash, self.sent.token_ids, block)
        else:
            self.fed_hash.extend(self.sent.token_ids)
        self.fed = self.fed_hash.length
        self.sent = None
        self.cached = 0

    def restart(self) -> None:
        """Start this request's state over under a new epoch: the whole context is replayed."""
        self.epoch += 1
        self.fed = 0
        self.fed_hash = ContextHasher(self.seq.hash_seed)
        self.block_ends = []
        self.sent = None
        self.cached = 0

    def rebuild(self, charge: bool = True) -> None:
        """Replay after something went wrong (counted against the recovery budget unless `charge` is False),
        cold: no cached prefix."""
        self.restart()
        self.no_prefix = True
        if charge:
            self.retries += 1

    @property
    def reserves(self) -> bool:
        """Whether its KV is held for its whole output budget from the start (a long generation)."""
        return self.seq.sampling.max_tokens >= settings.RESERVE_KV_OUTPUT_TOKENS

    @property
    def final_positions(self) -> int:
        """Context positions the stages hold at most for this request (prompt + every output but the last)."""
        return min(len(self.seq.prompt_ids) + self.seq.sampling.max_tokens - 1, self.seq.max_context)


@dataclass
class EngineFigures:
    """What the scheduler counts for Stats (docs/ARCHITECTURE.md "KV-aware scheduling and the prefix cache")."""

    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0             # context tokens of requests started (or restarted after a preemption)
    computed_tokens: int = 0           # context positions sent to be computed


def rank(req: Request) -> tuple[int, bool, int]:
    """Preemption order: the lowest priority goes first; within it, a request that did not reserve its KV
    before one that did (a long generation recomputed late wastes the most), then the youngest."""
    return req.priority.rank, not req.reserves, req.arrival


def start_class(req: Request, step: int, aging_steps: int = settings.PRIORITY_AGING_STEPS) -> int:
    """Start order among waiting requests: critical (0) before standard (1) before sheddable (2), each class
    one better for every `aging_steps` steps waited, so that a steady stream of higher priorities never starves
    a lower one."""
    return max(0, req.priority.rank - (step - req.queued_at) // aging_steps)


@dataclass
class Scheduler:
    num_stages: int
    max_slots: int
    max_tokens: int
    waiting: deque[Request] = field(default_factory=deque)
    running: dict[str, Request] = field(default_factory=dict)
    frames_in_flight: int = 0
    # At most this many active requests: one micro-batch in flight, not one per stage (settings.ALONE_MAX_REQUESTS;
    # the driver sets it from the handshake, 0 unless every stage widens a micro-batch alone).
    alone_max: int = 0
    ledger: BlockLedger = field(default_factory=BlockLedger)
    figures: EngineFigures = field(default_factory=EngineFigures)
    # Filled by next_batch for the driver: requests preempted (their Release to send) and requests that can
    # never fit in the route's KV (to fail).
    preempted: list[Request] = field(default_factory=list)
    impossible: list[Request] = field(default_factory=list)
    steps: int = 0                     # micro-batches scheduled so far (the clock of priority aging)
    # Ended requests whose Release is queued or under way (RELEASING), until every stage has answered.
    ended: dict[str, Request] = field(default_factory=dict)
    _arrivals: int = 0

    def add(self, req: Request) -> None:
        self._arrivals += 1
        req.arrival = self._arrivals
        req.queued_at = self.steps
        self.waiting.append(req)

    def remove(self, req: Request) -> bool:
        """It ended: out of the queues for good. True when its Release must be queued now (`Request.end`)."""
        release = req.end()
        self.running.pop(req.id, None)
        try:
            self.waiting.remove(req)
        except ValueError:
            pass
        return release

    @property
    def active(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def depth(self) -> int:
        """Micro-batches to keep in flight now: one per stage, or one alone while at most `alone_max` requests
        are active (every stage then runs it on all its cores; the request's tokens are the same bits)."""
        return 1 if 0 < self.active <= self.alone_max else self.num_stages

    def has_room(self) -> bool:
        return self.frames_in_flight < self.depth

    @property
    def num_preempted(self) -> int:
        return sum(1 for r in self.waiting if r.preempted)

    def confirmed(self, req: Request) -> None:
        """The frame of `req` landed on every stage: note it, and cache its new full blocks as they do."""
        start = len(req.block_ends)
        req.confirm(self.ledger.block)
        self.ledger.register(req.id, req.seq.hash_seed, req.seq.all_ids, req.block_ends, start)

    def released(self, request_id: str) -> None:
        """Every stage answered the Release of `request_id`: its blocks are free, and if it was preempted it
        may start again."""
        self.ledger.release_done(request_id)
        ended = self.ended.pop(request_id, None)
        if ended is not None:
            ended.released()
        for req in self.waiting:
            if req.id == request_id and req.releasing:
                req.released()

    def next_batch(self) -> list[Request]:
        """Requests for the next micro-batch, each marked in flight with the stamp it is sent with.

        The batch takes an even share of the active requests so that `depth` micro-batches keep the stages busy;
        running requests go first, then waiting ones by priority (aged: `start_class`) and arrival. At most `max_tokens` rows go
        in one frame: a prompt that does not fit is prefilled in chunks (batch invariance makes chunking
        invisible in the output), so long prompts never stall the decodes batched with them; while requests
        wait, a chunk takes at most half the rows, so a long prompt never stalls a short one behind it either.
        Every frame's positions are held in the ledger before it is sent.
        """
        if not self.has_room():
            return []
        share = min(self.max_slots, max(1, ceil_div(self.active, self.depth)))
        batch: list[Request] = []
        tokens = 0
        # Running requests first, in order (none of them can starve). While requests wait, running prefill
        # chunks take at most half the frame's rows (decodes always fit), so long prompts never hold every
        # frame while a short request waits to start.
        prefill_rows = self.max_tokens - (self.max_tokens // 2 if self.waiting else 0)
        for req in list(self.running.values()):
            if len(batch) >= share or tokens >= self.max_tokens:
                break
            if req.phase is not Phase.SETTLED or req.id not in self.running:
                continue
            n = min(req.pending, self.max_tokens - tokens)
            if n > 1:
                n = min(n, prefill_rows - tokens)
                if n < 1:
                    continue
            if not self._make_room(req, req.fed + n, batch):
                continue
            self.ledger.hold(req.id, req.fed + n)
            req.send(req.stamp(n), 0)
            batch.append(req)
            tokens += n
        if self.waiting:
            ordered = sorted(self.waiting, key=lambda r: start_class(r, self.steps))  # stable: FIFO within
            for req in ordered:
                if len(batch) >= share or tokens >= self.max_tokens:
                    break
                if req.releasing:
                    break              # its room is on the way back: nobody behind it takes it first
                if not self.ledger.fits(req.final_positions):
                    self.waiting.remove(req)
                    self.impossible.append(req)
                    continue
                rows = self._start(req, self.max_tokens - tokens)
                if rows is None:
                    break              # the head does not fit yet: FIFO within priority, nobody overtakes
                batch.append(req)
                tokens += rows
        for req in batch:
            assert req.sent is not None   # every request of the batch has its frame's stamp
            self.figures.computed_tokens += len(req.sent.token_ids) - req.cached
        if batch:
            self.frames_in_flight += 1
            self.steps += 1
        return batch

    def _start(self, req: Request, rows: int) -> int | None:
        """Move a waiting request into the running set if its whole context fits (after its cached prefix);
        its first frame's stamp is set. Returns the rows that frame computes, or None if it must wait."""
        ids = req.seq.all_ids
        consult = self.ledger.caching and not req.no_prefix and len(ids) > 1
        hit = self.ledger.cached_prefix(req.seq.hash_seed, ids) if consult else NO_HIT
        positions = max(len(ids), req.final_positions) if req.reserves else len(ids)
        if not self.ledger.can_hold(req.id, positions, hit):
            return None
        cached = hit.tokens(self.ledger.block)
        if hit:
            self.ledger.attach(req.id, hit)
        self.ledger.hold(req.id, positions)
        self.waiting.remove(req)
        self.running[req.id] = req
        req.start()
        n = min(len(ids) - cached, rows)
        req.send(req.stamp(n, cached), cached)
        f = self.figures
        f.prompt_tokens += len(ids)
        if consult:
            f.prefix_queries += 1
            if cached:
                f.prefix_hits += 1
                f.prefix_hit_tokens += cached
        return n

    def _make_room(self, req: Request, positions: int, batch: list[Request]) -> bool:
        """Make the ledger able to hold `positions` of `req`, preempting the lowest-priority, youngest running
        request (not in flight, not in this batch) while it cannot; False if `req` itself must yield or wait
        for frames in flight to come back."""
        while not self.ledger.can_hold(req.id, positions):
            if self.ledger.need(req.id, positions) <= self.ledger.pool.available + self.ledger.coming_back():
                return False           # a preemption's Release is under way: wait for it, preempt no one else
            taken = {id(r) for r in batch}
            candidates = [r for r in self.running.values() if r.phase is Phase.SETTLED and id(r) not in taken]
            if not candidates:
                return False
            victim = max(candidates, key=rank)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Release `req`'s blocks and send it back to the front of the queue; it is recomputed from its tokens
        later (a new epoch, not charged to its recovery budget)."""
        del self.running[req.id]
        self.ledger.release_begin(req.id)
        req.restart()
        req.preempt()
        req.queued_at = self.steps
        self.waiting.appendleft(req)
        self.preempted.append(req)
        self.figures.preemptions += 1

    def frame_done(self) -> None:
        self.frames_in_flight -= 1

    def frames_lost(self) -> None:
        """The stream broke or the driver restarted: no frame is in flight any more."""
        self.frames_in_flight = 0
