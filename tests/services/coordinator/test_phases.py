"""A request's lifecycle on a pipeline as one phase machine (services/coordinator/scheduler.py `Phase`): every
transition, the one rule "ended while in flight, so release it when the frame is over", and the refusals of
transitions a phase does not make."""

from __future__ import annotations

import pytest

from services.coordinator.scheduler import Phase, PhaseError, Request
from tether.generation.sequence import Sequence
from tether.model.loader import load_model_tokenizer, resolve_model
from tether.reference import sampling_params

TOK = load_model_tokenizer(resolve_model("tiny"))
W, P, S, F, Y, E, R, D = (Phase.WAITING, Phase.PREEMPTED, Phase.SETTLED, Phase.IN_FLIGHT, Phase.SYNCING,
                          Phase.ENDING, Phase.RELEASING, Phase.DONE)


def req() -> Request:
    return Request(Sequence("r", [65, 66, 67], sampling_params(max_tokens=8), TOK, 0, 4096))


def at(phase: Phase) -> Request:
    """A request brought to `phase` by transitions only."""
    r = req()
    path = {W: [], S: ["start"], F: ["start", "send"], Y: ["start", "send", "lose"],
            P: ["start", "preempt"], E: ["start", "send", "end"], R: ["start", "end"],
            D: ["end"]}[phase]
    for step in path:
        if step == "send":
            r.send(r.stamp(), 0)
        else:
            getattr(r, step)()
    assert r.phase is phase
    return r


# (from, transition, to, what it returns: True = "queue its Release now")
TRANSITIONS = [
    (W, "start", S, None), (S, "send", F, None), (F, "frame_over", S, False), (F, "lose", Y, False),
    (Y, "resynced", S, None), (S, "resynced", S, None), (S, "preempt", P, None), (P, "released", W, None),
    (W, "end", D, False), (P, "end", D, False), (S, "end", R, True), (Y, "end", R, True), (F, "end", E, False),
    (E, "frame_over", R, True), (E, "lose", R, True), (R, "released", D, None),
    (E, "end", E, False), (R, "end", R, False), (D, "end", D, False),    # ending twice changes nothing
]


@pytest.mark.parametrize("start, step, end, returns", TRANSITIONS,
                         ids=[f"{a.name}-{t}-{b.name}" for a, t, b, _ in TRANSITIONS])
def test_every_transition(start, step, end, returns):
    r = at(start)
    got = r.send(r.stamp(), 0) if step == "send" else getattr(r, step)()
    assert r.phase is end and got is returns


def test_every_phase_is_reached_and_left():
    reached = {b for _, _, b, _ in TRANSITIONS}
    left = {a for a, _, b, _ in TRANSITIONS if a is not b}
    assert reached == set(Phase) and left == set(Phase) - {D}   # DONE is the only end


@pytest.mark.parametrize("start, step", [
    (W, "send"), (F, "send"), (S, "start"), (F, "start"), (S, "frame_over"), (Y, "frame_over"), (S, "lose"),
    (F, "preempt"), (Y, "preempt"), (F, "resynced"), (W, "resynced"), (R, "start"), (D, "send"),
])
def test_a_transition_its_phase_does_not_make_is_refused(start, step):
    r = at(start)
    with pytest.raises(PhaseError, match=start.value):
        r.send(r.stamp(), 0) if step == "send" else getattr(r, step)()
    assert r.phase is start


def test_what_the_scheduler_and_driver_read_follows_the_phase():
    assert [p for p in Phase if at(p).in_flight] == [F, Y, E]   # not schedulable, not releasable yet
    assert [p for p in Phase if at(p).done] == [E, R, D]          # never scheduled again
    assert [p for p in Phase if at(p).releasing] == [P]           # preempted, its Release not answered


def test_cancelled_in_flight_then_the_frame_comes_back_releases_exactly_once():
    r = at(F)
    assert r.end() is False           # its frame is out: the stages may still be writing its state
    assert r.frame_over() is True     # the frame is over: now, once
    assert r.end() is False and r.phase is R
    r.released()
    assert r.phase is D
