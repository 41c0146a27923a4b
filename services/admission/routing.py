"""Which pipeline serves a request (pure logic: no gRPC, no asyncio; docs/ARCHITECTURE.md "Routing and overload").

In the spirit of the Gateway API Inference Extension's endpoint picker: *filter* the pipelines that can take
the request at all, *score* the rest with pluggable scorers, *pick* the best. The inputs are each pipeline's
last load report (streamed by its coordinator, services/coordinator/load.py), what admission itself has routed
there and not yet seen finish, and the request's features from the tagger — its "semantic weight": predicted
cost from its prompt length and output budget, its size class and its prefix key.

Round-robin and least-loaded stay selectable for comparison (`--route-policy`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tether import settings
from tether.mathutil import ceil_div

PREFIX_AFFINITY_ENTRIES = 65536   # prefix keys admission remembers (LRU): ~5 MB at most


@dataclass(frozen=True)
class PipelineLoad:
    """A pipeline as its coordinator last reported it (services/coordinator/load.py)."""

    name: str                       # the coordinator's address: what admission dials
    serving: bool = False
    max_context: int = 0            # positions one request may hold (0: unknown, no limit checked)
    kv_blocks_total: int = 0        # the smallest stage's pool (0: unknown)
    kv_blocks_free: int = 0         # free, or cached and evictable
    block_tokens: int = 64
    running: int = 0
    waiting: int = 0
    step_seconds: float = 0.0       # recent time from a frame's send to its reply
    work: float = 0.0               # predicted work of its running and waiting requests (RouteRequest.cost units)
    cache_generation: int = 0       # changes when the coordinator forgets its mirror of the stages' cache
    roles: frozenset[str] = frozenset()   # size classes this pipeline is for (empty: any), from admission's config


@dataclass(frozen=True)
class RouteRequest:
    """What routing knows of one request: the tags' features."""

    prompt_tokens: int
    max_tokens: int
    size_class: str = "short"
    priority: str = "standard"
    prefix_key: int = 0             # 0: no prefix worth following (admission.prefix_key)

    @property
    def cost(self) -> float:
        """Predicted work, in prefill-token units: the paper's semantic weight."""
        return self.prompt_tokens + settings.DECODE_TOKEN_COST * self.max_tokens

    @property
    def positions(self) -> int:
        """Context positions the request holds at most: prompt plus every output token but the last."""
        return self.prompt_tokens + max(0, self.max_tokens - 1)


@dataclass
class Candidate:
    """A pipeline that passed the filters, with what admission knows beyond its report."""

    load: PipelineLoad
    outstanding: float = 0.0        # predicted cost routed here by this admission and not finished
    in_flight: int = 0              # requests routed here by this admission and not finished
    prefix_hit: bool = False        # this admission sent the request's prefix here, cache unchanged since

    @property
    def backlog(self) -> float:
        """Work ahead of a new request: the coordinator's report (every admission's requests, a moment ago) or
        what this admission sent since (its own, now), whichever is more."""
        return max(self.outstanding, self.load.work)


@dataclass(frozen=True)
class Decision:
    pipeline: str
    policy: str
    reason: str                     # for the response's tags and the trace: why this pipeline
    scores: tuple[tuple[str, float], ...] = ()


class NoPipeline(Exception):
    """No pipeline can take the request; `retryable` says whether one may later (all busy or down), `kv` that
    it is the stages' KV pools, not the model's context window, that are too small for it."""

    def __init__(self, message: str, retryable: bool, kv: bool = False) -> None:
        super().__init__(message)
        self.retryable, self.kv = retryable, kv


# --- filters ------------------------------------------------------------------------------------------------

def can_ever_fit(load: PipelineLoad, req: RouteRequest) -> bool:
    """Whether the pipeline could hold the request's whole context with nothing else running."""
    if load.max_context and req.positions > load.max_context:
        return False
    if load.kv_blocks_total and ceil_div(req.positions, load.block_tokens) > load.kv_blocks_total:
        return False
    return True


def role_matches(load: PipelineLoad, req: RouteRequest) -> bool:
    return not load.roles or req.size_class in load.roles


# --- scorers: each maps a candidate to [0, 1], higher is better ----------------------------------------------

Scorer = Callable[[Candidate, RouteRequest], float]


def capacity_score(c: Candidate, req: RouteRequest) -> float:
    """Predicted cost against free capacity: the share of the pipeline's work that would be this request's.
    A pipeline with much outstanding work (or many running requests) scores low; an idle one near 1."""
    backlog = c.backlog
    return req.cost / (req.cost + backlog) if req.cost + backlog > 0 else 1.0


def kv_score(c: Candidate, req: RouteRequest) -> float:
    """KV room left after this request: fuller pools preempt sooner."""
    total = c.load.kv_blocks_total
    if not total:
        return 0.5
    need = ceil_div(req.positions, c.load.block_tokens)
    return max(0.0, c.load.kv_blocks_free - need) / total


def queue_score(c: Candidate, req: RouteRequest) -> float:
    """Requests already waiting there: a new request starts behind them."""
    return 1.0 / (1.0 + c.load.waiting + c.in_flight / 8)


def prefix_score(c: Candidate, req: RouteRequest) -> float:
    """The request's prefix was sent here and that pipeline has not forgotten its cache since."""
    return 1.0 if c.prefix_hit else 0.0


def role_score(c: Candidate, req: RouteRequest) -> float:
    """A pipeline given this size class's role is preferred to a general one."""
    return 1.0 if req.size_class in c.load.roles else 0.0


SCORERS: dict[str, Scorer] = {
    "capacity": capacity_score, "kv": kv_score, "queue": queue_score, "prefix": prefix_score, "role": role_score,
}
# Weights of the feature-aware policy. Prefix affinity is worth most while the target is not much busier
# (a hit saves the prefill), capacity next: the paper's semantic-weight balancing.
DEFAULT_WEIGHTS: dict[str, float] = {"capacity": 3.0, "prefix": 2.0, "queue": 1.0, "kv": 1.0, "role": 0.5}
POLICIES = settings.ROUTE_POLICIES


@dataclass
class PrefixAffinity:
    """Which pipelines this admission has sent each prefix key to, and each one's cache generation then (a
    bounded LRU over keys). A pipeline whose coordinator forgot its cache mirror bumps its generation, which
    voids its entries. Remembering every pipeline a key went to (not just the last) matters: a prefix that
    two pipelines both hold gives neither a reason to take more than its share of the load."""

    capacity: int = PREFIX_AFFINITY_ENTRIES
    entries: OrderedDict[int, dict[str, int]] = field(default_factory=OrderedDict)

    def lookup(self, key: int, loads: dict[str, PipelineLoad]) -> set[str]:
        held = self.entries.get(key) if key else None
        if not held:
            return set()
        for name, generation in list(held.items()):
            load = loads.get(name)
            if load is None or load.cache_generation != generation:
                del held[name]
        self.entries.move_to_end(key)
        return set(held)

    def note(self, key: int, load: PipelineLoad) -> None:
        if not key:
            return
        self.entries.setdefault(key, {})[load.name] = load.cache_generation
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


class Router:
    """Routes requests over a set of pipelines; `route` is called once per request on admission's loop."""

    def __init__(self, policy: str = "features", weights: dict[str, float] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.policy = policy
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        unknown = set(self.weights) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown scorer(s) {sorted(unknown)}: known are {sorted(SCORERS)}")
        self.affinity = PrefixAffinity()
        self._turn = itertools.count()

    def route(self, req: RouteRequest, loads: Sequence[PipelineLoad], outstanding: dict[str, float],
              in_flight: dict[str, int], allowed: Callable[[str], bool] = lambda name: True) -> Decision:
        """Pick a pipeline for `req`. `loads`: the last report of every configured pipeline; `outstanding` and
        `in_flight`: what this admission routed to each and has not seen finish; `allowed`: the circuit
        breakers. Raises NoPipeline when none can take it."""
        if not loads:
            raise NoPipeline("no pipeline is configured", retryable=False)
        fits = [p for p in loads if can_ever_fit(p, req)]
        if not fits:
            if all(not p.max_context or req.positions <= p.max_context for p in loads):
                most = max(p.kv_blocks_total * p.block_tokens for p in loads)
                raise NoPipeline(f"the request needs {req.positions} context positions of KV (prompt + max_tokens "
                                 f"- 1); the stages of every pipeline hold at most {most}", retryable=False, kv=True)
            biggest = max(p.max_context for p in loads)
            raise NoPipeline(f"the request needs {req.positions} context positions; no pipeline's model holds more "
                             f"than {biggest}", retryable=False)
        live = [p for p in fits if p.serving and allowed(p.name)]
        if not live:
            raise NoPipeline(f"none of the {len(fits)} pipeline(s) that could take the request is serving "
                             f"(down, recovering or its circuit breaker is open)", retryable=True)
        # Roles narrow the choice when a pipeline of the request's role is live; otherwise any will do.
        for_role = [p for p in live if req.size_class in p.roles] or [p for p in live if role_matches(p, req)] or live
        by_name = {p.name: p for p in loads}
        affine = self.affinity.lookup(req.prefix_key, by_name)
        candidates = [Candidate(p, outstanding.get(p.name, 0.0), in_flight.get(p.name, 0), p.name in affine)
                      for p in for_role]
        decision = self._pick(req, candidates)
        self.affinity.note(req.prefix_key, by_name[decision.pipeline])
        return decision

    def _pick(self, req: RouteRequest, candidates: list[Candidate]) -> Decision:
        if self.policy == "round-robin":
            c = candidates[next(self._turn) % len(candidates)]
            return Decision(c.load.name, self.policy, "round-robin")
        if self.policy == "least-loaded":
            c = min(candidates, key=lambda c: (c.load.running + c.load.waiting + c.in_flight, c.load.name))
            return Decision(c.load.name, self.policy,
                            f"least loaded: {c.load.running} running, {c.load.waiting} waiting, {c.in_flight} sent")
        scored = []
        for c in candidates:
            parts = tuple((name, SCORERS[name](c, req)) for name in self.weights)
            total = sum(self.weights[name] * s for name, s in parts)
            scored.append((total, c, parts))
        total, best, parts = max(scored, key=lambda t: (t[0], -t[1].in_flight, t[1].load.name))
        top = sorted(parts, key=lambda p: -self.weights[p[0]] * p[1])[:2]
        why = ", ".join(f"{name} {s:.2f}" for name, s in top)
        return Decision(best.load.name, self.policy, f"score {total:.2f} ({why})", parts)


def predicted_wait_s(load: PipelineLoad, in_flight: int, req: RouteRequest, slots_per_step: int,
                     tokens_per_step: int) -> float:
    """How long `req` would wait on this pipeline for its first token: the requests queued ahead of it start
    `slots_per_step` per engine step, then its prompt takes `tokens_per_step` rows a step; times the recent
    step time. 0 when the pipeline has not reported a step yet (nothing to predict from)."""
    if load.step_seconds <= 0:
        return 0.0
    ahead = max(load.waiting, in_flight - load.running)
    steps = 1 + ahead // max(1, slots_per_step) + ceil_div(req.prompt_tokens, max(1, tokens_per_step))
    return load.step_seconds * steps
