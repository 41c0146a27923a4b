"""One stage's step: verify a frame slot by slot, run the admitted slots through the layers, and produce
either the frame for the next stage or (on the last stage) a sampled token per slot.

No gRPC here: `process` takes a Frame and returns results and the next frame, so it is testable alone.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import cast

import torch

from services.stage_worker.state import Admitted, FrameView, Rejected, SlotView, StageState
from services.stage_worker.unchecked import UncheckedStageState
from tether import settings
from tether.generation import sampler
from tether.kv.paged import PagedKV
from tether.model import numerics
from tether.model.invariant import threads_for
from tether.model.llama import ModelSlice, SlotRows
from tether.protocol import tensors
from tether.protocol.stamp_key import StampKey
from tether.telemetry import tracing
from tether.v1 import stage_pb2

RejectReason = stage_pb2.RejectReason


@dataclass
class StepOutcome:
    results: list[stage_pb2.SlotResult] = field(default_factory=list)   # answered here (rejections, tokens)
    forward: stage_pb2.Frame | None = None                              # for the next stage (seq unset)


def echo(stamp: stage_pb2.Stamp) -> stage_pb2.Stamp:
    """The stamp as echoed back: everything but the token ids."""
    return stage_pb2.Stamp(request_id=stamp.request_id, epoch=stamp.epoch, position=stamp.position,
                           parent_hash=stamp.parent_hash, context_hash=stamp.context_hash,
                           sampling_digest=stamp.sampling_digest)


def alone(frame: stage_pb2.Frame) -> bool:
    """The coordinator's hint that this is the only micro-batch in the pipeline (`frames_in_flight`): the step
    may take every thread (the same bits on any count; a false hint costs speed, never a result)."""
    return frame.frames_in_flight == 1


def frame_digest(frame: stage_pb2.Frame, key: StampKey) -> int:
    return key.frame_digest(frame.activations.data, frame.slots)


@dataclass(frozen=True)
class FrameLimits:
    """What one frame may ask of this stage; advertised in the handshake and enforced here, whatever the
    coordinator sends (a peer that ignores them gets every slot rejected with BAD_FRAME, nothing run)."""

    max_rows: int = settings.STAGE_MAX_FRAME_ROWS
    max_slots: int = settings.STAGE_MAX_FRAME_SLOTS


class StageWorker:
    """One stage's model slice, its KV arena and request state, and the step that checks and runs a frame."""

    def __init__(self, model: ModelSlice, index: int, kv_capacity_tokens: int, dtype: str | None = None,
                 stamp_checks: bool = True, limits: FrameLimits = FrameLimits(),
                 stamp_key: StampKey | None = None, alone_threads: int = 0, threads: int = 0,
                 kv_prefault: bool = False) -> None:
        self.model = model
        # Threads a step takes when its frame is the only micro-batch in the pipeline (`alone`), the other stages'
        # cores then idle; 0: the process's own count, as any other step.
        self.alone_threads = alone_threads
        self.threads = threads or torch.get_num_threads()   # the process's count: what a step takes under load
        self.index = index
        self.dtype = dtype or numerics.name_of(model.dtype)   # what the handshake says and activations carry
        self.limits = limits
        self.kv_capacity_tokens = kv_capacity_tokens   # the budget as given; the arena holds whole blocks of it
        # The pipeline's stamp key, set by each handshake. None until then: every slot is refused (fail closed).
        self.stamp_key = stamp_key
        # Every request's KV lives in this arena; its block pool bounds the KV and keeps the prefix cache.
        self.arena = model.new_arena(kv_capacity_tokens, kv_prefault)
        # stamp_checks=False is --unsafe-disable-stamp-checks, decided here once: the experiment-only state class
        # without the checks (services/stage_worker/unchecked.py). Never a default.
        state = StageState if stamp_checks else UncheckedStageState
        self.state = state(self._new_kv, model.cfg.max_position_embeddings, self.arena.pool, self.block_tokens)
        self.started = time.monotonic()
        self.busy_seconds = 0.0                     # wall time in steps that ran slots
        self.sampling_seconds = 0.0                 # of it, drawing tokens from the logits (the last stage)
        self.steps = 0
        self.rejections: Counter[str] = Counter()   # RejectReason name -> slots rejected here
        self.refusals: Counter[str] = Counter()     # limit name -> frames refused by it

    def step_threads(self) -> tuple[int, int]:
        """The most threads a step takes under load, and alone (both within the rule's cap): what the handshake
        tells the coordinator, which keeps one micro-batch in flight while few requests are active only where
        every stage widens one alone."""
        rule = self.model.rows
        loaded = threads_for(1, rule, wide=self.threads)   # `wide`: that many, whatever the rows, within the cap
        return loaded, threads_for(1, rule, wide=self.alone_threads) if self.alone_threads else loaded

    def _new_kv(self, owner: str) -> PagedKV:
        return PagedKV(self.arena, owner)

    @property
    def block_tokens(self) -> int:
        """Positions per KV block, the unit of the prefix cache."""
        return self.arena.block

    def kv_used_tokens(self) -> int:
        return self.arena.used_blocks * self.arena.block

    def reject(self, slot: stage_pb2.Slot, reason: int, detail: str) -> stage_pb2.SlotResult:
        self.rejections[RejectReason.Name(reason)] += 1
        return stage_pb2.SlotResult(stamp=echo(slot.stamp), ok=False,
                                    reason=cast(stage_pb2.RejectReason, reason), detail=detail,
                                    stage_index=self.index)

    def reject_all(self, frame: stage_pb2.Frame, reason: int, detail: str) -> StepOutcome:
        return StepOutcome([self.reject(s, reason, detail) for s in frame.slots])

    def process(self, frame: stage_pb2.Frame) -> StepOutcome:
        """The frame's checks (the `frame` rows of state.CHECKS), then each slot's (`_admit_slots`), then run
        what passed."""
        if not frame.slots:
            return self._process(frame)
        t0 = time.perf_counter()
        try:
            return self._process(frame)
        finally:
            self.busy_seconds += time.perf_counter() - t0
            self.steps += 1

    def refused(self, level: str, view: FrameView) -> StepOutcome | None:
        """Walk the `stream` (the relay) or `frame` rows of the stage's checks (state.CHECKS); the first that
        fails rejects every slot of the frame."""
        found = self.state.refusal(level, view)
        if found is None:
            return None
        check, detail = found
        if check.refusal:
            self.refusals[check.refusal] += 1
        return self.reject_all(view.frame, check.reason, detail)

    def _process(self, frame: stage_pb2.Frame) -> StepOutcome:
        cfg, key = self.model.cfg, self.stamp_key
        view = FrameView(frame, key=key, max_slots=self.limits.max_slots, max_rows=self.limits.max_rows,
                         has_embedding=self.model.has_embedding, has_head=self.model.has_head,
                         vocab=cfg.vocab_size, hidden=cfg.hidden_size, dtype=self.dtype)
        outcome = self.refused("frame", view)
        if outcome is not None:
            return outcome
        assert key is not None   # the `keyed` row passed
        if not frame.slots:   # a keep-alive: it travels the whole route so that no hop's stream idles out
            if self.model.has_head:
                return StepOutcome()
            return StepOutcome(forward=self._next_frame(frame, key, [], torch.empty(0, cfg.hidden_size,
                                                                                 dtype=self.model.dtype)))
        hidden = view.activations
        out = StepOutcome()
        admitted: list[tuple[stage_pb2.Slot, Admitted, int]] = []   # slot, admission, first row
        try:
            self._admit_slots(view, key, admitted, out)
        except Exception:
            # e.g. the arena failing to grow: nothing admitted so far may stay half-allocated and unfindable
            for _, a, _ in admitted:
                self.state.abandon(a)
            raise
        if not admitted:
            return out
        try:
            h = self._run(frame, admitted, hidden)
        except Exception:
            for _, a, _ in admitted:
                self.state.abandon(a)
            raise
        for _, a, _ in admitted:
            self.state.commit(a)
        if self.model.has_head:
            out.results.extend(self._sample(key, admitted, h, self._wide(frame)))
        else:
            out.forward = self._next_frame(frame, key, admitted, h)
        return out

    def _admit_slots(self, frame: FrameView, key: StampKey, admitted: list, out: StepOutcome) -> None:
        """Per slot, its `slot` rows of the checks (the MAC, a request twice, the vocabulary, the sampling
        digest), its `state` rows (StageState.check) and room in the KV (NO_CAPACITY); append what passed to
        `admitted` (with its first row), reject the rest."""
        row = 0
        for slot in frame.frame.slots:
            try:
                found = self.state.refusal("slot", SlotView(slot, frame, None, None, None))
                if found is not None:
                    raise Rejected(found[0].reason, found[1])
                a = self.state.check(slot)
                self.state.reserve(a)
                admitted.append((slot, a, row))
            except Rejected as e:
                out.results.append(self.reject(slot, e.reason, e.detail))
            row += len(slot.stamp.token_ids) - slot.cached_prefix

    def _run(self, frame, admitted, hidden: torch.Tensor | None) -> torch.Tensor:
        slots = [SlotRows(a.state.kv, a.start, a.rows) for _, a, _ in admitted]
        if hidden is None:
            x = torch.tensor([t for _, a, _ in admitted for t in a.token_ids[a.cached:]], dtype=torch.long)
        else:
            x = torch.cat([hidden[r:r + a.rows] for _, a, r in admitted])
        return self.model(x, slots, self._wide(frame))

    def _wide(self, frame: stage_pb2.Frame) -> int:
        """The threads this step may take whatever its rows (ModelSlice's `wide`): alone_threads when alone."""
        return self.alone_threads if alone(frame) else 0

    def _sample(self, key: StampKey, admitted, h: torch.Tensor, wide: int) -> list[stage_pb2.SlotResult]:
        ends, params, positions = [], [], []
        row = 0
        for slot, a, _ in admitted:
            row += a.rows
            if slot.sample:
                ends.append(row - 1)
                params.append(slot.sampling)
                positions.append(a.position + len(a.token_ids))
        # Every sampled slot in one batched draw: the tokens of sampler.sample row by row, in a few ops
        tokens: list[int] = []
        if ends:
            last = h if len(ends) == h.shape[0] else h.index_select(0, torch.tensor(ends))   # decode: every row
            # alone (`wide`), the other stages' cores are idle: the rows' draws take as many threads
            logits = self.model.logits(last, wide)
            t0 = time.perf_counter()
            tokens = sampler.sample_rows(logits, params, positions, threads=max(wide, 1))
            self.sampling_seconds += time.perf_counter() - t0
        results, k = [], 0
        for slot, a, _ in admitted:
            res = stage_pb2.SlotResult(stamp=echo(slot.stamp), ok=True, stage_index=self.index)
            if slot.sample:
                res.has_token = True
                token = tokens[k]
                res.token_id = token
                # committed chain + the token, bound (keyed) to the request id, epoch, position and the
                # parameters actually used
                res.token_hash = key.token_mac(a.state.hasher.peek([token]), slot.stamp.request_id, slot.stamp.epoch,
                                               a.position + len(a.token_ids), self.state.token_digest(slot), token)
                k += 1
            results.append(res)
        return results

    def _next_frame(self, frame, key: StampKey, admitted, h: torch.Tensor) -> stage_pb2.Frame:
        nxt = stage_pb2.Frame(pipeline_epoch=frame.pipeline_epoch, slots=[s for s, _, _ in admitted],
                              activations=tensors.encode(h), frames_in_flight=frame.frames_in_flight)
        nxt.payload_digest = frame_digest(nxt, key)
        return nxt


class _RequestSpan:
    __slots__ = ("span", "steps", "rows")

    def __init__(self, span: tracing.Span) -> None:
        self.span, self.steps, self.rows = span, 0, 0


class StageTraces:
    """This stage's spans (only while tracing is on; the step thread is the only one that touches them).

    Per traced request (a slot with a `traceparent`): one span `stage{i} request`, child of the coordinator's
    span of it, from its first frame here until its state is released (Release, lease, a new coordinator);
    its rejections here are events with their reason, its step count and computed rows attributes.
    Per step that carries at least one traced slot: one span `stage{i} step` (the shared work: every slot of
    the frame), linked to the request span of each traced slot in it, so a request's trace leads to the
    steps it took part in and a step to every traced request it served. Nothing per token beyond a counter.
    """

    MAX_OPEN = 4096   # request spans open at once; past it the oldest ends (a lost Release must not leak)

    def __init__(self, worker: StageWorker) -> None:
        self.worker = worker
        self.open: dict[str, _RequestSpan] = {}

    def _request(self, slot: stage_pb2.Slot) -> _RequestSpan | None:
        rid = slot.stamp.request_id
        r = self.open.get(rid)
        if r is None:
            parent = tracing.parent(slot.traceparent)
            if parent is None:   # not a W3C traceparent: telemetry only, so ignored, never an error
                return None
            m = self.worker.model
            span = tracing.start(f"stage{self.worker.index} request", parent, tracing.SpanKind.SERVER,
                                 {"tether.request_id": rid, "tether.stage_index": self.worker.index,
                                  "tether.layer_start": m.layer_start, "tether.layer_end": m.layer_end})
            r = self.open[rid] = _RequestSpan(span)
            while len(self.open) > self.MAX_OPEN:
                self._end(next(iter(self.open)), "evicted")
        return r

    def process(self, frame: stage_pb2.Frame) -> StepOutcome:
        """The worker's step, inside a step span when some slot is traced."""
        traced = []
        for slot in frame.slots:   # tracing on: one string read per slot; only traced slots cost more
            if slot.traceparent:
                r = self._request(slot)
                if r is not None:
                    traced.append((slot, r))
        if not traced:
            return self.worker.process(frame)
        step = tracing.start(f"stage{self.worker.index} step",
                             links=[tracing.Link(r.span.get_span_context()) for _, r in traced],
                             attributes={"tether.stage_index": self.worker.index, "tether.slots": len(frame.slots),
                                         "tether.traced_slots": len(traced)})
        try:
            outcome = self.worker.process(frame)
        except Exception as e:
            tracing.fail(step, type(e).__name__, str(e))
            step.end()
            raise
        rejected = {res.stamp.request_id: res for res in outcome.results
                    if not res.ok and res.stage_index == self.worker.index}
        for slot, r in traced:
            res = rejected.get(slot.stamp.request_id)
            if res is not None:
                reason = RejectReason.Name(res.reason) if res.reason in RejectReason.values() else str(res.reason)
                r.span.add_event("rejection", {"tether.reason": reason, "tether.detail": res.detail,
                                               "tether.epoch": slot.stamp.epoch,
                                               "tether.position": slot.stamp.position})
            else:
                r.steps += 1
                r.rows += len(slot.stamp.token_ids) - slot.cached_prefix
        if rejected:
            step.set_attribute("tether.rejected_slots", len(rejected))
        step.end()
        return outcome

    def _end(self, request_id: str, why: str) -> None:
        r = self.open.pop(request_id, None)
        if r is not None:
            r.span.set_attributes({"tether.steps": r.steps, "tether.rows": r.rows, "tether.ended_by": why})
            r.span.end()

    def released(self, request_ids, why: str) -> None:
        """The state of these requests is gone from this stage: their spans end."""
        if self.open:
            for rid in request_ids:
                self._end(rid, why)
