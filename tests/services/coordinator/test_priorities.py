"""The tags drive scheduling (pure logic): priority classes with aging so nothing starves, and KV reserved up
front for requests whose output budget says they will be long."""

from __future__ import annotations

from services.coordinator.scheduler import Request, Scheduler, start_class
from tether.generation.sequence import Sequence
from tether.mathutil import ceil_div
from tether.model.loader import load_model_tokenizer, resolve_model
from tether.priority import Priority
from tether.protocol.hashing import hash_seed
from tether.reference import sampling_params
from tests.helpers import answer_frame

SEED = hash_seed("fp", "")
TOK = load_model_tokenizer(resolve_model("tiny"))


def req(rid: str, priority: str = "standard", max_tokens: int = 8, prompt: int = 4) -> Request:
    ids = [65 + i % 26 for i in range(prompt)]
    return Request(Sequence(rid, ids, sampling_params(max_tokens=max_tokens), TOK, SEED, 4096), priority=Priority(priority))


def test_start_class_ages_one_class_per_aging_period():
    r = req("a", "sheddable")
    r.queued_at = 10
    assert [start_class(r, 10 + k, aging_steps=5) for k in (0, 4, 5, 9, 10, 50)] == [2, 2, 1, 1, 0, 0]
    assert start_class(req("b", "critical"), 0, 5) == 0


def run_steps(s: Scheduler, steps: int) -> list[str]:
    """Schedule `steps` frames, each one answered at once (decode tokens appended): ids in start order."""
    started: list[str] = []
    for _ in range(steps):
        batch = s.next_batch()
        for r in batch:
            if r.fed == 0 and r.id not in started:
                started.append(r.id)
        answer_frame(s, batch)
        for r in batch:
            if r.seq.finished:
                s.remove(r)
    return started


def test_critical_before_standard_before_sheddable():
    s = Scheduler(num_stages=1, max_slots=1, max_tokens=512)
    s.ledger.configure(1000, 4, True)
    for rid, p in [("s1", "sheddable"), ("n1", "standard"), ("c1", "critical"), ("n2", "standard")]:
        s.add(req(rid, p, max_tokens=1))
    assert run_steps(s, 4) == ["c1", "n1", "n2", "s1"]


def _stream_of_critical(aging_steps: int) -> list[str]:
    """One sheddable request waiting while a new critical one arrives before every step (one slot per frame)."""
    import services.coordinator.scheduler as scheduler
    original = scheduler.start_class
    scheduler.start_class = lambda r, step: original(r, step, aging_steps)
    try:
        s = Scheduler(num_stages=1, max_slots=1, max_tokens=512)
        s.ledger.configure(1000, 4, True)
        s.add(req("late", "sheddable", max_tokens=1))
        started: list[str] = []
        for k in range(12):
            s.add(req(f"c{k}", "critical", max_tokens=1))
            started += run_steps(s, 1)
    finally:
        scheduler.start_class = original
    return started


def test_a_sheddable_request_is_not_starved_by_a_steady_stream_of_critical_ones():
    started = _stream_of_critical(aging_steps=3)
    assert "late" in started and started.index("late") <= 7, started   # two classes of aging: 6 steps


def test_without_aging_the_same_stream_starves_it():
    """The control: with an aging period longer than the run, the sheddable request never starts."""
    assert "late" not in _stream_of_critical(aging_steps=10**9)


def test_a_long_budget_holds_its_whole_kv_from_the_start():
    s = Scheduler(num_stages=1, max_slots=8, max_tokens=512)
    s.ledger.configure(1000, 4, True)
    long = req("long", max_tokens=300, prompt=8)
    short = req("short", max_tokens=8, prompt=8)
    s.add(long)
    s.add(short)
    run_steps(s, 1)
    assert len(s.ledger.held["long"]) == ceil_div(8 + 300 - 1, 4)    # prompt + budget - 1 positions
    assert len(s.ledger.held["short"]) == 2                         # just its prompt, grown as it decodes


def _outgrow(reserve_from: int) -> tuple[Request, Request, Scheduler]:
    """An older medium request and a younger long one that together outgrow the pool (360 positions)."""
    import services.coordinator.scheduler as scheduler
    original = scheduler.settings.RESERVE_KV_OUTPUT_TOKENS
    scheduler.settings.RESERVE_KV_OUTPUT_TOKENS = reserve_from
    try:
        s = Scheduler(num_stages=1, max_slots=8, max_tokens=512)
        s.ledger.configure(90, 4, True)
        other, long = req("other", max_tokens=200, prompt=8), req("long", max_tokens=300, prompt=8)
        s.add(other)
        s.add(long)
        run_steps(s, 320)
    finally:
        scheduler.settings.RESERVE_KV_OUTPUT_TOKENS = original
    return other, long, s


def test_a_reserved_long_request_is_not_preempted_by_anothers_decode_growth():
    other, long, s = _outgrow(256)
    assert long.seq.finished and long.epoch == 1          # never restarted
    assert s.figures.preemptions == 1 and other.preempted  # the one that outgrew its room yields


def test_without_the_reservation_the_younger_long_request_is_preempted():
    other, long, s = _outgrow(10**9)
    assert long.epoch > 1 or long.preempted
