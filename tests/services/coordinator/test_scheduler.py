"""The coordinator's continuous batching (pure logic): shares, in-flight bounds, priorities, budgets, stamps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.coordinator.scheduler import Request, Scheduler
from services.stage_worker.worker import echo
from tether.generation.sequence import Sequence
from tether.mathutil import ceil_div
from tether.model.loader import load_model_tokenizer, resolve_model
from tether.priority import from_peer
from tether.protocol.hashing import context_hash, hash_seed
from tether.reference import sampling_params

SEED = hash_seed("fp", "")
TOK = load_model_tokenizer(resolve_model("tiny"))


def req(rid: str, prompt_len: int = 4, priority: str = "standard", max_tokens: int = 100) -> Request:
    seq = Sequence(rid, [65 + i % 26 for i in range(prompt_len)], sampling_params(max_tokens=max_tokens), TOK,
                   SEED, 4096)
    return Request(seq, priority=from_peer(priority))   # as the coordinator reads a SubmitRequest


def complete(sched: Scheduler, batch: list[Request], token: int = 66) -> None:
    """What the driver does when a frame's echoes all match: confirm, append (unless the stamp was a
    prefill chunk, which samples nothing), free the frame slot."""
    sched.frame_done()
    for r in batch:
        assert r.echo_matches(echo(r.sent))
        samples = r.samples
        r.frame_over()
        r.confirm()
        if samples:
            r.seq.append(token)


def ids(batch) -> list[str]:
    return [r.id for r in batch]


@pytest.mark.parametrize("stages,active,max_slots", [(2, 8, 32), (3, 10, 32), (4, 4, 32), (4, 3, 32),
                                                      (2, 9, 32), (4, 40, 6), (1, 5, 32)])
def test_micro_batches_take_an_even_share(stages, active, max_slots):
    sched = Scheduler(num_stages=stages, max_slots=max_slots, max_tokens=10_000)
    for i in range(active):
        sched.add(req(f"r{i}"))
    share = min(max_slots, max(1, ceil_div(active, stages)))
    batches = []
    while b := sched.next_batch():
        batches.append(b)
    assert len(batches) == min(stages, ceil_div(active, share))   # S frames in flight when load allows
    assert all(len(b) == share for b in batches[:-1]) and 0 < len(batches[-1]) <= share
    assert sched.frames_in_flight == len(batches) <= stages
    seen = [r.id for b in batches for r in b]
    assert len(seen) == len(set(seen)) == min(active, share * stages)
    assert all(r.in_flight and r.sent is not None for b in batches for r in b)


def test_no_room_means_no_batch_and_no_state_change():
    sched = Scheduler(num_stages=2, max_slots=32, max_tokens=10_000)
    for i in range(6):
        sched.add(req(f"r{i}"))
    b1, b2 = sched.next_batch(), sched.next_batch()
    assert len(b1) == len(b2) == 3 and not sched.has_room()
    sched.add(req("late"))
    assert sched.next_batch() == [] and sched.frames_in_flight == 2
    assert [r.id for r in sched.waiting] == ["late"]
    complete(sched, b1)
    b3 = sched.next_batch()
    # 7 active over 2 stages: a share of 4; running requests whose frame came back go first, then waiting ones
    assert ids(b3) == ["r0", "r1", "r2", "late"]
    assert not set(ids(b3)) & set(ids(b2)) and not sched.has_room()


@pytest.mark.parametrize("active", [1, 2, 8, 16])
def test_few_active_requests_go_in_one_micro_batch_alone(active):
    """alone_max (set where every stage widens a micro-batch alone): at most that many active requests make one
    micro-batch, the only one in flight, so each stage runs it on all its cores."""
    sched = Scheduler(num_stages=2, max_slots=32, max_tokens=10_000, alone_max=16)
    for i in range(active):
        sched.add(req(f"r{i}"))
    batch = sched.next_batch()
    assert len(batch) == active and sched.frames_in_flight == 1
    assert not sched.has_room() and sched.next_batch() == []   # no second micro-batch while it is out
    complete(sched, batch)
    assert ids(sched.next_batch()) == ids(batch)               # back: all of them again, in one


def test_past_alone_max_a_micro_batch_per_stage_again():
    sched = Scheduler(num_stages=2, max_slots=32, max_tokens=10_000, alone_max=4)
    for i in range(4):
        sched.add(req(f"r{i}"))
    alone = sched.next_batch()
    assert len(alone) == 4 and not sched.has_room()
    sched.add(req("r4"))                    # 5 active: one micro-batch per stage, the newcomer in the second
    assert sched.has_room() and ids(sched.next_batch()) == ["r4"] and sched.frames_in_flight == 2
    complete(sched, alone)
    assert len(sched.next_batch()) == 3     # an even share of 5 over 2 stages
    sched.remove(alone[0])
    sched.remove(alone[1])                  # 3 active again, but two micro-batches are still out: wait for them
    assert sched.frames_in_flight == 2 and sched.next_batch() == []


def test_alone_max_zero_keeps_one_micro_batch_per_stage():
    sched = Scheduler(num_stages=2, max_slots=32, max_tokens=10_000)   # the default: 0
    for i in range(4):
        sched.add(req(f"r{i}"))
    assert len(sched.next_batch()) == len(sched.next_batch()) == 2 and sched.frames_in_flight == 2


def test_a_request_is_never_in_two_frames():
    sched = Scheduler(num_stages=4, max_slots=32, max_tokens=10_000)
    for i in range(3):
        sched.add(req(f"r{i}"))
    frames = []
    while b := sched.next_batch():
        frames.append(b)
    assert sorted(ids(r for b in frames for r in b)) == ["r0", "r1", "r2"]
    # room for another frame, but every request is in flight: nothing is scheduled twice
    assert sched.has_room() and sched.next_batch() == []


@pytest.mark.parametrize("seed", range(25))
def test_invariants_under_random_traffic(seed):
    """Random arrivals, completions, rejections and cancellations never break the in-flight invariants."""
    import random

    rng = random.Random(seed)
    stages = rng.randint(1, 4)
    sched = Scheduler(num_stages=stages, max_slots=rng.randint(1, 8), max_tokens=rng.randint(8, 64))
    in_flight: list[list[Request]] = []
    n = 0
    for _ in range(200):
        op = rng.random()
        if op < 0.3:
            sched.add(req(f"r{n}", prompt_len=rng.randint(1, 20), priority=rng.choice(["critical", "standard",
                                                                                          "sheddable"])))
            n += 1
        elif op < 0.7:
            b = sched.next_batch()
            if b:
                in_flight.append(b)
                tokens = sum(len(r.sent.token_ids) for r in b)
                assert len(b) == 1 or tokens <= sched.max_tokens
                assert len(b) <= sched.max_slots
        elif in_flight:
            b = in_flight.pop(rng.randrange(len(in_flight)))
            sched.frame_done()
            for r in b:
                if r.frame_over():                      # cancelled while in flight
                    pass
                elif rng.random() < 0.2:
                    r.rebuild()
                else:
                    r.confirm()
                    if r.seq.append(66).finish_reason:
                        sched.remove(r)
            if rng.random() < 0.1 and sched.running:
                sched.remove(rng.choice(list(sched.running.values())))
        # invariants
        assert 0 <= sched.frames_in_flight == len(in_flight) <= stages
        flying = [r.id for b in in_flight for r in b]
        assert len(flying) == len(set(flying)), "a request is in two frames"
        for r in sched.running.values():
            assert r.in_flight == (r.id in flying)
            assert not r.done
        assert not set(r.id for r in sched.waiting) & set(sched.running)


def test_priority_order_of_waiting_requests():
    sched = Scheduler(num_stages=1, max_slots=1, max_tokens=10_000)
    order = [("s1", "sheddable"), ("n1", "standard"), ("c1", "critical"), ("s2", "sheddable"),
             ("c2", "critical"), ("n2", "standard"), ("x1", "unknown-priority")]
    for rid, prio in order:
        sched.add(req(rid, priority=prio))
    got = []
    while sched.waiting:
        b = sched.next_batch()
        assert len(b) == 1
        got.append(b[0].id)
        sched.frame_done()
        sched.remove(b[0])                      # finished: never scheduled again
    # critical before standard before sheddable, arrival order within a class; unknown counts as standard
    assert got == ["c1", "c2", "n1", "n2", "x1", "s1", "s2"]


def test_running_requests_go_before_waiting_ones():
    sched = Scheduler(num_stages=1, max_slots=2, max_tokens=10_000)
    sched.add(req("old1", priority="sheddable"))
    sched.add(req("old2", priority="sheddable"))
    b = sched.next_batch()
    complete(sched, b)
    sched.add(req("new", priority="critical"))
    assert ids(sched.next_batch()) == ["old1", "old2"]


def test_max_tokens_budget_chunks_the_prompt_that_does_not_fit():
    sched = Scheduler(num_stages=1, max_slots=32, max_tokens=25)
    for i in range(5):
        sched.add(req(f"r{i}", prompt_len=10))
    b = sched.next_batch()
    assert ids(b) == ["r0", "r1", "r2"] and [len(r.sent.token_ids) for r in b] == [10, 10, 5]
    assert [r.samples for r in b] == [True, True, False]       # r2's first chunk samples nothing
    complete(sched, b)
    # two decodes (1 row each), the rest of r2's prompt (5), then r3 (10) and a chunk of r4 (25 - 17 = 8)
    b = sched.next_batch()
    assert ids(b) == ["r0", "r1", "r2", "r3", "r4"]
    assert [len(r.sent.token_ids) for r in b] == [1, 1, 5, 10, 8]
    assert b[2].sent.position == 5 and b[2].samples and not b[4].samples


def test_an_oversized_prompt_is_prefilled_in_chunks():
    sched = Scheduler(num_stages=1, max_slots=32, max_tokens=8)
    sched.add(req("big", prompt_len=20))
    sched.add(req("small", prompt_len=2))
    chunks = []
    while True:
        b = sched.next_batch()
        assert sum(len(r.sent.token_ids) for r in b) <= 8
        chunks.append([(r.id, r.sent.position, len(r.sent.token_ids), r.samples) for r in b])
        done = any(r.id == "big" and r.samples for r in b)
        complete(sched, b)
        if done:
            break
    # while "small" waits, big's chunk takes half the rows: small starts in the second frame, not after big
    assert chunks == [[("big", 0, 8, False)], [("big", 8, 4, False), ("small", 0, 2, True)], [("big", 12, 8, True)]]
    big = sched.running["big"]
    assert big.fed == 20 and big.fed_hash.value == context_hash(SEED, big.seq.prompt_ids)


def test_waiting_requests_keep_their_order_when_the_budget_is_full():
    """A big waiting request is not overtaken by a later small one (no starvation of long prompts)."""
    sched = Scheduler(num_stages=1, max_slots=32, max_tokens=12)
    sched.add(req("a", prompt_len=10))
    sched.add(req("big", prompt_len=10))
    sched.add(req("small", prompt_len=1))
    b = sched.next_batch()
    assert ids(b) == ["a", "big"] and len(b[1].sent.token_ids) == 2     # big starts with what fits
    assert [r.id for r in sched.waiting] == ["small"]


def test_stamp_confirm_and_fed_hash():
    r = req("a", prompt_len=6)
    sched = Scheduler(num_stages=1, max_slots=4, max_tokens=100)
    sched.add(r)
    [got] = sched.next_batch()
    prompt = r.seq.prompt_ids
    assert got is r and r.in_flight
    assert (r.sent.request_id, r.sent.epoch, r.sent.position) == ("a", 1, 0)
    assert list(r.sent.token_ids) == prompt
    assert r.sent.parent_hash == context_hash(SEED, []) and r.sent.context_hash == context_hash(SEED, prompt)
    assert r.fed == 0
    sched.frame_done()
    r.frame_over()
    r.confirm()
    assert r.fed == 6 and r.fed_hash.value == context_hash(SEED, prompt)
    assert not r.in_flight and r.sent is None
    r.seq.append(70)
    s = r.stamp()
    assert s.position == 6 and list(s.token_ids) == [70]
    assert s.parent_hash == context_hash(SEED, prompt)
    assert s.context_hash == context_hash(SEED, prompt + [70])
    [again] = sched.next_batch()
    assert again is r and r.sent == s
    sched.frame_done()
    r.frame_over()
    r.confirm()
    assert r.fed == 7 and r.fed_hash.value == context_hash(SEED, prompt + [70])


def test_rebuild_bumps_epoch_and_replays_from_zero():
    r = req("a", prompt_len=5)
    sched = Scheduler(num_stages=1, max_slots=4, max_tokens=100)
    sched.add(r)
    sched.next_batch()
    sched.frame_done()
    r.frame_over()
    r.confirm()
    r.seq.append(70)
    sched.next_batch()                       # in flight with position 5 ...
    sched.frame_done()
    r.frame_over()
    r.rebuild()                              # ... and rejected
    assert r.epoch == 2 and r.fed == 0 and r.retries == 1 and not r.in_flight and r.sent is None
    assert r.fed_hash.length == 0 and r.fed_hash.value == context_hash(SEED, [])
    [b] = sched.next_batch()
    assert b is r and r.sent.epoch == 2 and r.sent.position == 0
    assert list(r.sent.token_ids) == r.seq.all_ids and len(r.sent.token_ids) == 6
    assert r.sent.parent_hash == context_hash(SEED, []) and r.sent.context_hash == r.seq.hasher.value
    r.rebuild()
    assert r.epoch == 3 and r.retries == 2


def test_echo_matches_only_the_exact_stamp():
    r = req("a")
    sched = Scheduler(num_stages=1, max_slots=4, max_tokens=100)
    sched.add(r)
    sched.next_batch()
    good = echo(r.sent)
    assert r.echo_matches(good)
    for field, change in [("context_hash", lambda v: v ^ 1), ("parent_hash", lambda v: v ^ 1),
                          ("epoch", lambda v: v + 1), ("epoch", lambda v: v - 1), ("position", lambda v: v + 1),
                          ("request_id", lambda v: v + "x"), ("request_id", lambda v: "")]:
        bad = type(good)()
        bad.CopyFrom(good)
        setattr(bad, field, change(getattr(bad, field)))
        assert not r.echo_matches(bad), field
    other = req("b")
    other.sent = other.stamp()
    assert not r.echo_matches(echo(other.sent))
    r.confirm()
    assert not r.echo_matches(good)          # nothing in flight: no echo matches


def test_removed_requests_are_never_scheduled():
    sched = Scheduler(num_stages=2, max_slots=4, max_tokens=100)
    a, b = req("a"), req("b")
    sched.add(a)
    sched.add(b)
    sched.remove(b)                          # cancelled while waiting
    assert b.done and ids(sched.next_batch()) == ["a"]
    sched.remove(a)                          # cancelled while in flight
    assert a.done and "a" not in sched.running
    sched.frame_done()
    assert sched.next_batch() == []
    sched.remove(a)                          # idempotent


@given(prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=12), stages=st.integers(1, 4),
       max_slots=st.integers(1, 6), max_tokens=st.integers(1, 80))
@settings(max_examples=100, deadline=None, database=None)
def test_first_batch_respects_slots_and_budget(prompt_lens, stages, max_slots, max_tokens):
    sched = Scheduler(num_stages=stages, max_slots=max_slots, max_tokens=max_tokens)
    for i, n in enumerate(prompt_lens):
        sched.add(req(f"r{i}", prompt_len=n))
    b = sched.next_batch()
    share = min(max_slots, max(1, ceil_div(len(prompt_lens), stages)))
    assert 1 <= len(b) <= share
    assert len(b) == 1 or sum(len(r.sent.token_ids) for r in b) <= max_tokens
    assert ids(b) == [f"r{i}" for i in range(len(b))]       # FIFO within one priority


def test_a_long_prefill_is_not_starved_by_a_stream_of_new_requests():
    """New requests keep arriving (a closed loop at capacity): the long prompt still progresses every frame,
    by at least half the rows, and samples its first token in bounded time (the soak's 240 s hangs)."""
    sched = Scheduler(num_stages=1, max_slots=4, max_tokens=8)
    sched.add(req("big", prompt_len=40, max_tokens=1))
    for frame in range(40):
        sched.add(req(f"short{frame}", prompt_len=7, max_tokens=1))
        b = sched.next_batch()
        sampled = any(r.id == "big" and r.samples for r in b)
        complete(sched, b)
        for r in list(sched.running.values()):
            if r.seq.finished:
                sched.remove(r)
        if sampled:
            break
    assert sampled and frame <= 40 // 4 + 1, frame
