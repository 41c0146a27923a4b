"""The fault ledger: which slots each injected fault hit, and whether the coordinator caught it or let it slip.

Pure logic: no gRPC, no clock. It writes every fault and outcome to the ``tether.faults`` log, which the chaos
tests and the chaos bench read back from the services' logs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tether.faults.spec import FOLLOWED
from tether.v1 import stage_pb2

log = logging.getLogger("tether.faults")   # the name the chaos tests and bench read the services' logs by


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
