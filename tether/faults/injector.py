"""The fault injector: draws each fault and applies it to a copy of a frame or reply.

Pure logic: no gRPC, no clock, no tasks. It only decides; where it sits, the sleeping (delay), the late
flush of a held frame (reorder) and the dying (crash) are the caller's (tether/faults/effects.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tether.faults.ledger import Fault, FaultLedger
from tether.faults.spec import KINDS, FaultConfig
from tether.v1 import stage_pb2


@dataclass
class HeldFrames:
    """Per-stream reorder buffer: the frame(s) held back to go out after the stream's next frame."""

    frames: list[stage_pb2.Frame] = field(default_factory=list)
    fault: Fault | None = None        # the reorder fault that holds them

    def take(self) -> list[stage_pb2.Frame]:
        out, self.frames, self.fault = self.frames, [], None
        return out

    def __bool__(self) -> bool:
        return bool(self.frames)


class FaultInjector:
    """Decides and applies faults; `counts` says how many of each kind were injected.

    Hooks, in the order a stage meets them: `crash()` and `forget(frame)` when a frame arrives;
    `delay_s()` and `outbound(frame, held)` when a frame goes to the next hop (`flush(held)` when a held
    frame's successor did not come within `config.hold_s`); `reply(reply)` on a reply the caller answers.
    """

    def __init__(self, config: FaultConfig | None = None) -> None:
        self.config = config or FaultConfig()
        self.enabled = self.config.enabled
        self.counts: dict[str, int] = {k: 0 for k in KINDS}
        self.ledger = FaultLedger()   # which slots each fault hit, and whether the coordinator caught it
        # One generator per kind: a kind's decisions do not shift when another kind's rate changes.
        self._rng = {k: random.Random(f"tether-faults|{self.config.seed}|{k}") for k in KINDS}
        self._held = HeldFrames()     # for callers with a single outbound stream

    # --- decisions ----------------------------------------------------------------------------------------
    def _draw(self, kind: str) -> bool:
        rate = self.config.rate(kind)
        return rate > 0 and self._rng[kind].random() < rate

    def _count(self, kind: str) -> None:
        self.counts[kind] += 1

    def crash(self) -> bool:
        """Should the process die now? (The caller exits; the injector only decides.)"""
        if self._draw("crash"):
            self._count("crash")
            return True
        return False

    def forget(self, frame: stage_pb2.Frame) -> str | None:
        """A request of `frame` whose state the stage should drop before processing it, or None.

        Only slots past position 0 qualify: they are the ones whose state the stage must already hold.
        """
        if self.config.rate("forget_kv") <= 0:
            return None
        self.ledger.observe("arrival", [s.stamp for s in frame.slots])
        if not self._draw("forget_kv"):
            return None
        stamps = [s.stamp for s in frame.slots if s.stamp.position > 0 and s.stamp.request_id]
        if not stamps:
            return None
        self._count("forget_kv")
        stamp = self._rng["forget_kv"].choice(stamps)
        self.ledger.record("forget_kv", "arrival", [stamp])
        return stamp.request_id

    def delay_s(self) -> float:
        """Seconds to sleep before sending the next frame (0.0 when no delay is drawn)."""
        if self._draw("delay"):
            self._count("delay")
            return self.config.delay_ms / 1000
        return 0.0

    # --- frames going out ---------------------------------------------------------------------------------
    def outbound(self, frame: stage_pb2.Frame, held: HeldFrames | None = None) -> list[stage_pb2.Frame]:
        """The frames to actually send, in order, in place of `frame`.

        `held` is the stream's reorder buffer (one per outbound stream; omit it for the injector's own).
        A frame held for reorder is returned after the next frame, including when that next one is dropped.
        """
        held = self._held if held is None else held
        if not self.enabled:
            return [*held.take(), frame]
        stamps = [s.stamp for s in frame.slots]
        self.ledger.observe("outbound", stamps)
        if self._draw("drop"):
            self._count("drop")
            self.ledger.record("drop", "outbound", stamps)
            if held.fault is not None:
                self.ledger.harmless(held.fault, "went out in order after all")   # in its own place
            return held.take()
        frame = self._mutate(frame)
        frames = [frame]
        if self._draw("duplicate"):
            self._count("duplicate")
            self.ledger.record("duplicate", "outbound", stamps)
            frames.append(_copy(frame))
        if held:
            return frames + held.take()   # the earlier frame goes after this one: the reorder happens now
        if self._draw("reorder"):
            self._count("reorder")
            held.frames = frames
            held.fault = self.ledger.record("reorder", "outbound", stamps)
            return []
        return frames

    def flush(self, held: HeldFrames | None = None) -> list[stage_pb2.Frame]:
        """The held frame(s), to send now that no successor came in time (they arrive late, not reordered)."""
        held = self._held if held is None else held
        if held.fault is not None:
            self.ledger.harmless(held.fault, "went out in order after all")
        return held.take()

    def _mutate(self, frame: stage_pb2.Frame) -> stage_pb2.Frame:
        out = frame
        if self._draw("corrupt"):
            f = _copy(out)
            hit = _corrupt_frame(f, self._rng["corrupt"])
            if hit is not None:
                self._count("corrupt")
                self.ledger.record("corrupt", "outbound",
                                   [s.stamp for s in frame.slots] if hit < 0 else [frame.slots[hit].stamp])
                out = f
        if self._draw("swap_slots") and len(out.slots) >= 2:
            out = _copy(out) if out is frame else out
            i, j = self._rng["swap_slots"].sample(range(len(out.slots)), 2)
            fault = self.ledger.record("swap_slots", "outbound", [out.slots[i].stamp, out.slots[j].stamp])
            if _twins(out.slots[i].stamp, out.slots[j].stamp, epochs=False):
                self.ledger.harmless(fault, _SAME_ROWS)
            a = stage_pb2.Stamp()
            a.CopyFrom(out.slots[i].stamp)
            out.slots[i].stamp.CopyFrom(out.slots[j].stamp)
            out.slots[j].stamp.CopyFrom(a)
            self._count("swap_slots")
        if self._draw("cross_ids") and len(out.slots) >= 2:
            out = _copy(out) if out is frame else out
            i, j = self._rng["cross_ids"].sample(range(len(out.slots)), 2)
            si, sj = out.slots[i].stamp, out.slots[j].stamp
            fault = self.ledger.record("cross_ids", "outbound", [si, sj])
            if _twins(si, sj):
                self.ledger.harmless(fault, _TWINS)
            si.request_id, sj.request_id = sj.request_id, si.request_id
            self._count("cross_ids")
        return out

    # --- replies ------------------------------------------------------------------------------------------
    def reply(self, reply: stage_pb2.FrameReply) -> stage_pb2.FrameReply:
        """Faults on a reply: two results swap request ids (cross_ids), one token id changes (corrupt)."""
        if not self.enabled:
            return reply
        self.ledger.observe("reply", [r.stamp for r in reply.results], [r.ok for r in reply.results])
        out = reply
        if self._draw("cross_ids") and len(out.results) >= 2:
            out = _copy(out)
            i, j = self._rng["cross_ids"].sample(range(len(out.results)), 2)
            si, sj = out.results[i].stamp, out.results[j].stamp
            # only an ok result could be taken for a token; a rejection is rebuilt on whatever its id says
            self.ledger.record("cross_ids", "reply", [r.stamp for r in (out.results[i], out.results[j]) if r.ok])
            si.request_id, sj.request_id = sj.request_id, si.request_id
            self._count("cross_ids")
        if self._draw("corrupt"):
            tokens = [r for r in range(len(out.results)) if out.results[r].has_token]
            if tokens:
                out = _copy(out) if out is reply else out
                res = out.results[self._rng["corrupt"].choice(tokens)]
                res.token_id ^= 1 << self._rng["corrupt"].randrange(4)   # stays in its 16-aligned vocab group
                self.ledger.record("corrupt", "reply", [res.stamp])
                self._count("corrupt")
        return out


_TWINS = "twin slots: the same context, epoch and position; only their ids differ"
_SAME_ROWS = "twin slots: the same context and position (their rows are the same bits); only ids and epochs differ"


def _twins(a: stage_pb2.Stamp, b: stage_pb2.Stamp, epochs: bool = True) -> bool:
    """Two stamps equal but for their request ids (and, with `epochs=False`, their epochs): two requests with
    the same prompt, sampling and tokens so far, at the same position. Their rows are the same bits (batch
    invariance), so exchanging their ids at the same epoch, or their whole stamps (ids and epochs travel
    together) at any epochs, changes nothing a stage computes (a reply still binds the id in its token hash)."""
    a, b = _copy(a), _copy(b)
    a.request_id = b.request_id = ""
    a.mac = b.mac = 0   # the MAC binds the id and epoch: twins differ there and only there
    if not epochs:
        a.epoch = b.epoch = 0
    return a == b


def _copy(msg):
    c = type(msg)()
    c.CopyFrom(msg)
    return c


def _corrupt_frame(f: stage_pb2.Frame, rng: random.Random) -> int | None:
    """Flip one byte of the activations (-1: every slot is hit), or (no activations) one token id of one stamp
    (that slot's index). None if neither applies."""
    if f.HasField("activations") and f.activations.data:
        data = bytearray(f.activations.data)
        data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        f.activations.data = bytes(data)
        return -1
    slots = [i for i, s in enumerate(f.slots) if s.stamp.token_ids]
    if not slots:
        return None
    hit = rng.choice(slots)
    ids = f.slots[hit].stamp.token_ids
    ids[rng.randrange(len(ids))] ^= 1 << rng.randrange(4)   # a different, still small token id
    return hit
