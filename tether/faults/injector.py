"""Fault injection on the stage protocol: built into the product, off unless a spec turns it on.

A spec names a probability per fault kind (per frame, or per reply for the reply-side kinds) plus a few
parameters, e.g. ``drop=0.02,corrupt=0.05,delay=0.1,delay_ms=50,seed=7``. It comes from a service's
``--faults`` flag or the ``TETHER_FAULTS`` environment variable. Pure logic, no gRPC, no clock: callers
decide where the injector sits and do the sleeping, the forgetting and the dying themselves.

What each kind does, and where it applies:

| kind        | hook              | effect                                                                        |
|-------------|-------------------|-------------------------------------------------------------------------------|
| drop        | outbound          | the frame is not sent                                                         |
| duplicate   | outbound          | the frame is sent twice (same ``stream_seq``)                                 |
| reorder     | outbound          | the frame is held back and sent right after the next frame on that stream;   |
|             |                   | if no next frame comes within ``hold_ms`` the caller flushes it (sent late)   |
| delay       | delay_s           | the caller sleeps ``delay_ms`` before sending                                 |
| corrupt     | outbound, reply   | frame: one byte of ``activations.data`` XORed, or (no activations) one token  |
|             |                   | id of one stamp changed, hashes left as they were; reply: one token id changed|
| swap_slots  | outbound          | two slots exchange their stamps; their rows stay where they were              |
| cross_ids   | outbound, reply   | two slots (or two results) exchange request ids only                          |
| forget_kv   | forget            | names a request of the frame whose state the stage drops before processing   |
| crash       | crash             | the caller exits the process at once (``os._exit(137)``)                      |

Every decision comes from a ``random.Random`` per kind, seeded from ``seed`` and the kind's name, so a
kind's decisions are reproducible and independent of the other kinds' rates. Every fault applied is counted
exactly once in ``counts``; a drawn fault that cannot apply (``swap_slots`` on a one-slot frame) is not.
The caller's messages are never mutated: a faulted frame or reply is a copy.

Each injected fault is also written to the ``tether.faults`` log with the slots it hit, as
``request_id@epoch:position`` (``fault 7 corrupt at outbound: r1@1:12 r2@3:0``), and for the kinds in
``FOLLOWED`` the injector then watches what the coordinator did about it: the next frame (or reply) of that
request through the same hook says whether the faulted slot was **caught** (a newer epoch: rebuilt; or the same
epoch and position again: resent after a sync) or **SLIPPED** through (the same epoch at a later position: the
coordinator confirmed the faulted frame and appended its token). See `FaultLedger`. A reorder whose held frame
went out in order after all (its successor was dropped, or it was flushed late), and a swap_slots or cross_ids
between twin slots (equal stamps but for the ids: two identical requests in step) did no harm and are logged so.
`duplicate` is logged but not followed: its copy is refused by the next hop's sequence check while the
original goes through, so the request rightly carries on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from tether import settings
from tether.v1 import stage_pb2

log = logging.getLogger("tether.faults")

KINDS = ("drop", "duplicate", "reorder", "delay", "corrupt", "swap_slots", "cross_ids", "forget_kv", "crash")
PARAMS = ("seed", "delay_ms", "hold_ms")
ENV = settings.FAULTS_ENV   # "TETHER_FAULTS"
DEFAULT_DELAY_MS = 50.0
# Kinds whose faulted slots the ledger follows to an outcome (caught or slipped); see FaultLedger.
FOLLOWED = ("drop", "reorder", "corrupt", "swap_slots", "cross_ids", "forget_kv")


def _spec_error(msg: str) -> ValueError:
    return ValueError(f"{msg}; a fault spec is KIND=RATE,... with RATE a probability in [0, 1] "
                      f"(kinds: {', '.join(KINDS)}) and optional {', '.join(p + '=N' for p in PARAMS)}, "
                      f"e.g. 'drop=0.02,corrupt=0.05,delay=0.1,delay_ms=50,seed=7'")


@dataclass(frozen=True)
class FaultConfig:
    rates: Mapping[str, float] = field(default_factory=dict)   # kind -> probability per frame / reply
    seed: int = 0
    delay_ms: float = DEFAULT_DELAY_MS
    hold_ms: float | None = None      # how long a reorder-held frame waits for a successor (default 2 × delay)

    @property
    def enabled(self) -> bool:
        return any(r > 0 for r in self.rates.values())

    def rate(self, kind: str) -> float:
        return self.rates.get(kind, 0.0)

    @property
    def hold_s(self) -> float:
        return (2 * self.delay_ms if self.hold_ms is None else self.hold_ms) / 1000

    @classmethod
    def parse(cls, spec: str | None) -> FaultConfig:
        """Parse 'drop=0.02,corrupt=0.05,delay_ms=50,seed=7'; empty or None means off."""
        rates: dict[str, float] = {}
        params: dict[str, float] = {}
        for item in (spec or "").split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise _spec_error(f"fault spec item {item!r} is not KEY=VALUE")
            if key in rates or key in params:
                raise _spec_error(f"fault spec names {key!r} twice")
            if key in KINDS:
                try:
                    rate = float(value)
                except ValueError:
                    raise _spec_error(f"rate of {key!r} must be a number, got {value!r}") from None
                if not 0.0 <= rate <= 1.0:   # also refuses nan
                    raise _spec_error(f"rate of {key!r} must be in [0, 1], got {value}")
                rates[key] = rate
            elif key == "seed":
                try:
                    params[key] = int(value) if value.lstrip("+-").isdigit() else int(value, 0)   # 7, 007, 0x7
                except ValueError:
                    raise _spec_error(f"seed must be an integer, got {value!r}") from None
            elif key in PARAMS:
                try:
                    ms = float(value)
                except ValueError:
                    raise _spec_error(f"{key} must be a number of milliseconds, got {value!r}") from None
                if not (math.isfinite(ms) and ms >= 0):
                    raise _spec_error(f"{key} must be >= 0, got {value}")
                params[key] = ms
            else:
                raise _spec_error(f"unknown fault {key!r}")
        return cls(rates=rates, seed=int(params.get("seed", 0)),
                   delay_ms=params.get("delay_ms", DEFAULT_DELAY_MS), hold_ms=params.get("hold_ms"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultConfig:
        """The spec in TETHER_FAULTS (off when unset or empty)."""
        return cls.parse((os.environ if environ is None else environ).get(ENV, ""))

    def spec(self) -> str:
        """The canonical spec string (``parse(c.spec()) == c``)."""
        items = [f"{k}={self.rates[k]:g}" for k in KINDS if k in self.rates]
        items.append(f"seed={self.seed}")
        items.append(f"delay_ms={self.delay_ms:g}")
        if self.hold_ms is not None:
            items.append(f"hold_ms={self.hold_ms:g}")
        return ",".join(items)



Slot = tuple[str, int, int]    # (request_id, epoch, position) of a stamp


def _slot(stamp: stage_pb2.Stamp) -> Slot:
    return (stamp.request_id, stamp.epoch, stamp.position)


def _fmt(slot: Slot) -> str:
    return f"{slot[0]}@{slot[1]}:{slot[2]}"


@dataclass
class Fault:
    """One injected fault: its number in this injector, its kind, the hook it was applied at and its slots."""

    number: int
    kind: str
    hook: str                                                   # "arrival", "outbound" or "reply"
    slots: tuple[Slot, ...]
    outcomes: dict[Slot, str] = field(default_factory=dict)     # slot -> "caught" | "slipped"
    harmless: bool = False                                      # a reorder that went out in order after all
    hashes: dict[Slot, tuple[int, int]] = field(default_factory=dict)   # slot -> (parent_hash, context_hash)


class FaultLedger:
    """What each injected fault hit, and (for FOLLOWED kinds) whether the coordinator acted on it.

    The coordinator keeps one frame in flight per request and, for each, either confirms it (appends the token,
    or takes the prefill chunk as held) and sends the next position in the same epoch, or discards it: a
    rebuild (next epoch, from position 0) or a resend of the same position after a sync. So the next frame of a
    faulted request through the same hook tells which happened. `observe` is given every frame (reply) the hook
    sees *before* any fault is drawn for it; a frame of an older epoch or position (a late or reordered copy) says
    nothing and is skipped, and so does one under the request's id that is not its own chain (ids crossed
    upstream, on their way to being refused): a resend must have the faulted stamp's parent hash, and only the
    continuation (parent hash = the faulted stamp's context hash) says the faulted frame was confirmed. At the reply hook a same-position result counts as a resend only if it is ok (a
    stage's BAD_SEQUENCE answer to a duplicate echoes the same stamp), and a reply fault records only the ok
    results it hit (a rejection cannot become a token; its echo may already carry an upstream fault's ids). A
    request that ends (finished, failed) right after the fault leaves the slot open: the caller decides what
    that means from how the request ended. Open slots are capped (oldest forgotten) so that an injector left on
    cannot grow without bound."""

    MAX_OPEN = 4096

    def __init__(self) -> None:
        self.recorded = 0
        self.outcomes: dict[tuple[str, str], int] = {}          # (kind, "caught" | "slipped") -> slots
        self._open: dict[tuple[str, str], list[tuple[Fault, Slot]]] = {}   # (hook, request_id) -> open slots
        self._n_open = 0

    def record(self, kind: str, hook: str, stamps) -> Fault:
        self.recorded += 1
        fault = Fault(self.recorded, kind, hook, tuple(_slot(s) for s in stamps),
                      hashes={_slot(s): (s.parent_hash, s.context_hash) for s in stamps})
        log.info("fault %d %s at %s: %s", fault.number, kind, hook, " ".join(_fmt(x) for x in fault.slots))
        if kind in FOLLOWED:
            for slot in fault.slots:
                self._open.setdefault((hook, slot[0]), []).append((fault, slot))
                self._n_open += 1
            while self._n_open > self.MAX_OPEN:
                key = next(iter(self._open))
                self._n_open -= len(self._open.pop(key))
        return fault

    def harmless(self, fault: Fault, why: str) -> None:
        """A fault that turned out to change nothing (a reorder sent in order after all, two twin slots
        exchanged): nothing to catch."""
        fault.harmless = True
        for slot in fault.slots:
            entries = self._open.get((fault.hook, slot[0]), [])
            kept = [e for e in entries if e[0] is not fault]
            self._n_open -= len(entries) - len(kept)
            if kept:
                self._open[(fault.hook, slot[0])] = kept
            else:
                self._open.pop((fault.hook, slot[0]), None)
        log.info("fault %d %s: harmless (%s)", fault.number, fault.kind, why)

    def observe(self, hook: str, stamps, ok=None) -> None:
        """A frame's (reply's) stamps as the hook sees them, before any fault; `ok` per stamp at the reply hook."""
        if not self._open:
            return
        for i, stamp in enumerate(stamps):
            entries = self._open.get((hook, stamp.request_id))
            if not entries:
                continue
            kept = []
            for fault, slot in entries:
                _, epoch, position = slot
                parent, context = fault.hashes[slot]
                if stamp.epoch > epoch or (stamp.epoch == epoch and stamp.position == position
                                           and stamp.parent_hash == parent and (ok is None or ok[i])):
                    outcome = "caught"
                elif stamp.epoch == epoch and stamp.position > position and stamp.parent_hash == context:
                    outcome = "slipped"   # the very continuation of the faulted frame: it was confirmed
                else:
                    kept.append((fault, slot))
                    continue
                fault.outcomes[slot] = outcome
                key = (fault.kind, outcome)
                self.outcomes[key] = self.outcomes.get(key, 0) + 1
                self._n_open -= 1
                log.log(logging.INFO if outcome == "caught" else logging.ERROR,
                        "fault %d %s: %s %s (next seen %s)", fault.number, fault.kind, _fmt(slot),
                        "caught" if outcome == "caught" else "SLIPPED THROUGH", _fmt(_slot(stamp)))
            if kept:
                self._open[(hook, stamp.request_id)] = kept
            else:
                del self._open[(hook, stamp.request_id)]

    @property
    def open_slots(self) -> list[tuple[Fault, Slot]]:
        return [e for entries in self._open.values() for e in entries]

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


class OutboundFaults:
    """An injector applied to one outbound stream (a stage's downstream, the coordinator's Forward): the
    delay, then whatever `outbound` returns, written in order. A frame held back for reordering whose
    successor does not come within `hold_s` goes out alone, late."""

    def __init__(self, injector: FaultInjector, write: Callable[[stage_pb2.Frame], Awaitable[None]]) -> None:
        self.injector = injector
        self.write = write
        self.held = HeldFrames()
        self.flush_task: asyncio.Task | None = None

    async def send(self, frame: stage_pb2.Frame) -> None:
        delay = self.injector.delay_s()
        if delay:
            await asyncio.sleep(delay)
        for f in self.injector.outbound(frame, self.held):
            await self.write(f)
        if self.held and self.flush_task is None:
            self.flush_task = asyncio.create_task(self._flush_later())
        elif not self.held and self.flush_task is not None:
            self.flush_task.cancel()   # still asleep: the held frame went out behind this one
            self.flush_task = None

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.injector.config.hold_s)
        self.flush_task = None         # from here on, not cancellable by `send`: the frames are taken
        try:
            for f in self.injector.flush(self.held):
                await self.write(f)
        except Exception:   # noqa: BLE001 - the stream broke; its reader reports that
            pass

    async def drain(self) -> None:
        """The stream ends: a frame still held goes out now (in order: nothing came after it)."""
        for f in self.injector.flush(self.held):
            await self.write(f)

    def close(self) -> None:
        if self.flush_task is not None:
            self.flush_task.cancel()
            self.flush_task = None
        self.held.take()


def add_experiment_flags(parser: argparse.ArgumentParser, where: str) -> None:
    """`--faults` and `--unsafe-disable-stamp-checks`, the same on every service that has them."""
    parser.add_argument(
        "--faults", default=os.environ.get(settings.FAULTS_ENV, ""), metavar="SPEC",
        help=f"inject faults into {where}, e.g. 'drop=0.02,corrupt=0.05,delay=0.1,delay_ms=50,seed=7'; kinds: "
             f"{', '.join(KINDS)} (rates are probabilities per frame). Default: ${settings.FAULTS_ENV}, off "
             f"when empty. For chaos tests only")
    parser.add_argument(
        "--unsafe-disable-stamp-checks", action="store_true",
        help="EXPERIMENT ONLY, NEVER IN SERVING: turn off the integrity checks (stamps, digests, sequence, "
             "echoes), so that faults reach the answers. It exists only to reproduce the wrong answers those "
             "checks prevent (run it with --faults)")


def experiment_config(parser: argparse.ArgumentParser, args: argparse.Namespace, log: logging.Logger) -> FaultConfig:
    """The parsed `--faults` (a bad spec is a usage error), with loud warnings for anything switched on."""
    try:
        config = FaultConfig.parse(args.faults)
    except ValueError as e:
        parser.error(f"--faults: {e}")
    if args.unsafe_disable_stamp_checks:
        log.warning("!" * 100)
        log.warning("STAMP CHECKS ARE DISABLED (--unsafe-disable-stamp-checks): this service CAN DELIVER ANOTHER "
                    "REQUEST'S OR GARBLED TOKENS. Experiment only: never serve traffic like this.")
        log.warning("!" * 100)
    if config.enabled:
        log.warning("fault injection ON: %s", config.spec())
    return config
