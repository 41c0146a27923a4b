"""KV-aware scheduling (pure logic): admission only when a context fits, preemption of the lowest-priority,
youngest request when decode growth runs out, cached prefixes from the ledger, and the ledger's block
accounting against the policy every stage runs."""

from __future__ import annotations

from services.coordinator.ledger import BlockLedger
from services.coordinator.scheduler import Request, Scheduler
from tether.generation.sequence import Sequence
from tether.kv.blocks import BlockPool, NoCapacity, PrefixHit, block_keys
from tether.model.loader import load_model_tokenizer, resolve_model
from tether.priority import Priority
from tether.protocol.hashing import hash_seed
from tether.reference import sampling_params
from tests.helpers import answer_frame

import pytest

SEED = hash_seed("fp", "")
TOK = load_model_tokenizer(resolve_model("tiny"))
B = 4   # a small block keeps the figures readable


def req(rid: str, prompt: list[int] | int = 4, priority: str = "standard", max_tokens: int = 100,
        seed: int = SEED) -> Request:
    ids = prompt if isinstance(prompt, list) else [65 + i % 26 for i in range(prompt)]
    return Request(Sequence(rid, list(ids), sampling_params(max_tokens=max_tokens), TOK, seed, 4096),
                   priority=Priority(priority))


def sched_with(capacity: int, caching: bool = True, stages: int = 1) -> Scheduler:
    s = Scheduler(num_stages=stages, max_slots=32, max_tokens=10_000)
    s.ledger.configure(capacity, B, caching)
    return s


def finish(s: Scheduler, r: Request) -> None:
    """What the driver does when a request ends: remove it, release, and the stages answer."""
    s.remove(r)
    s.ledger.release_begin(r.id)
    s.released(r.id)


# --- the block pool (the policy the stages and the ledger share) -----------------------------------------------

def test_pool_evicts_cached_blocks_least_recently_used_and_only_when_free_ones_run_out():
    p = BlockPool(4)
    a, b = p.allocate(1), p.allocate(1)
    p.register(a[0], "a")
    p.register(b[0], "b")
    p.release(a)
    p.release(b)                                   # LRU order: a, then b
    assert p.available == 4 and p.counters.evictions == 0
    p.allocate(2)                                  # two never-used blocks: nothing evicted
    assert p.counters.evictions == 0 and p.lookup("a") is not None
    p.allocate(1)
    assert p.counters.evictions == 1 and p.lookup("a") is None and p.lookup("b") is not None
    with pytest.raises(NoCapacity):
        p.allocate(2)                              # all or nothing
    assert p.lookup("b") is not None and p.counters.evictions == 1


def test_pool_touches_a_reused_block_so_it_is_evicted_last():
    p = BlockPool(3)
    a, b = p.allocate(1), p.allocate(1)
    p.register(a[0], "a")
    p.register(b[0], "b")
    p.release(a)
    p.release(b)
    p.acquire(a)                                   # a prefix hit on a: it is the most recently used now
    p.release(a)
    p.allocate(2)                                  # one fresh + one eviction: b goes, not a
    assert p.lookup("a") is not None and p.lookup("b") is None


def test_a_shared_block_is_freed_only_by_its_last_holder():
    p = BlockPool(2)
    a = p.allocate(1)
    p.register(a[0], "k")
    p.acquire(a)
    assert p.release(a) == [] and p.used == 1
    assert p.release(a) == [] and p.used == 0 and list(p.evictable) == a   # cached, not free


def test_match_stops_at_the_first_unconfirmed_block():
    p = BlockPool(4)
    blocks = p.allocate(3)
    for i, bl in enumerate(blocks):
        p.register(bl, i, info=f"tokens{i}")
    assert p.match([0, 1, 2]) == blocks
    assert p.match([0, 1, 2], confirm=lambda i, b, e, prev: e.info != "tokens1") == blocks[:1]
    assert p.match([0, 9, 2]) == blocks[:1]


def test_inner_keys_find_the_longest_start_and_leave_with_their_block():
    p = BlockPool(3)
    a, b = p.allocate(1), p.allocate(1)
    p.register(a[0], "a", inner=[11, 12, 13])
    p.register(b[0], "b", inner=[11, 22])              # 11 is a's already: b answers 22 only
    assert p.entry(b[0]).inner == (22,)
    assert p.match_inner([11, 12, 99]) == (a[0], 2)    # the last value some block answers
    assert p.match_inner([11, 22]) == (b[0], 2)
    assert p.match_inner([11, 12], confirm=lambda bl, e, n: n < 2) == (a[0], 1)   # a refused start: a shorter one
    assert p.match_inner([98, 99]) is None
    p.release(a)
    p.release(b)
    p.allocate(2)                                      # one fresh, then a evicted (least recently used)
    assert p.match_inner([11, 12]) is None and 12 not in p.inner and p.inner == {22: b[0]}
    p.drop_cache()
    assert p.inner == {}


# --- admission and growth ----------------------------------------------------------------------------------------

def test_a_request_is_admitted_only_when_its_whole_context_fits():
    s = sched_with(capacity=4)
    s.add(req("a", prompt=9, max_tokens=3))        # 3 blocks
    s.add(req("b", prompt=9, max_tokens=3))        # 3 more: does not fit beside a
    batch = s.next_batch()
    assert [r.id for r in batch] == ["a"] and s.ledger.used == 3
    assert [r.id for r in s.waiting] == ["b"]


def test_a_request_that_can_never_fit_is_refused_not_queued_forever():
    s = sched_with(capacity=4)
    s.add(req("huge", prompt=10, max_tokens=20))  # 29 positions > 16
    s.add(req("ok", prompt=2, max_tokens=3))
    assert [r.id for r in s.next_batch()] == ["ok"]
    assert [r.id for r in s.impossible] == ["huge"] and not s.waiting


def test_decode_growth_preempts_the_lowest_priority_youngest_request():
    s = sched_with(capacity=3)
    old = req("old", prompt=4, max_tokens=8)       # 1 block each to start
    crit = req("crit", prompt=4, max_tokens=8, priority="critical")
    young = req("young", prompt=4, max_tokens=8)
    for r in (old, crit, young):
        s.add(r)
    batch = s.next_batch()
    assert {r.id for r in batch} == {"old", "crit", "young"} and s.ledger.used == 3
    answer_frame(s, batch)                         # each holds 5 positions of context now: needs 2 blocks
    batch = s.next_batch()
    # crit first (priority order at admission), then old: young, the lowest-ranked, is preempted for room
    assert s.figures.preemptions >= 1 and young.preempted and young.releasing
    assert young in s.preempted and young.id not in s.running and s.waiting[0] is young
    assert young.epoch == 2 and young.fed == 0 and young.retries == 0   # not charged to its budget
    assert all(r.id != "young" for r in batch)


def test_a_preempted_request_waits_for_its_release_then_recomputes_its_whole_context():
    s = sched_with(capacity=16)                    # room to spare: only the pending Release holds b back
    a, b = req("a", prompt=4, max_tokens=8), req("b", prompt=4, max_tokens=8)
    s.add(a)
    s.add(b)
    answer_frame(s, s.next_batch())
    s._preempt(b)                                  # (as _make_room does when decode growth runs out)
    assert b.preempted and b.releasing and s.preempted == [b] and s.waiting[0] is b
    assert b.epoch == 2 and b.fed == 0 and b.retries == 0        # not charged to its budget
    a.send(a.stamp(), 0)                           # a's next frame is out; the stages have room for b
    assert s.next_batch() == [] and b.id not in s.running        # but its Release is not answered yet
    s.released(b.id)                               # every stage answered it
    assert not b.releasing
    batch = s.next_batch()
    assert batch == [b] and b.sent.position == 0 and list(b.sent.token_ids) == b.seq.all_ids
    assert b.sent.epoch == 2 and not b.preempted


def critical_and_sheddable_in_two_blocks() -> tuple[Scheduler, Request, Request]:
    """A pool of two blocks holding a critical and a sheddable request, each past its first frame: the next
    decode of either needs a third block."""
    s = sched_with(capacity=2)
    hi = req("hi", prompt=4, max_tokens=4, priority="critical")
    lo = req("lo", prompt=4, max_tokens=4, priority="sheddable")
    s.add(hi)
    s.add(lo)
    answer_frame(s, s.next_batch())
    return s, hi, lo


def test_one_preemption_at_a_time_and_the_room_goes_to_whoever_needed_it():
    s, hi, lo = critical_and_sheddable_in_two_blocks()
    assert s.next_batch() == [] and s.preempted == [lo] and not hi.preempted   # hi waits for lo's Release
    assert s.next_batch() == [] and s.figures.preemptions == 1                 # and no one else is preempted
    s.released(lo.id)
    assert s.next_batch() == [hi] and s.ledger.used == 2 and lo.id not in s.running


def test_a_request_preempts_itself_when_everyone_else_outranks_it():
    s, hi, lo = critical_and_sheddable_in_two_blocks()
    hi.send(hi.stamp(), 0)                         # hi's next frame is out: lo can only preempt itself
    s.running.pop("hi")
    s.running["hi"] = hi                           # lo is first in running order now
    batch = s.next_batch()
    assert batch == [] and s.preempted == [lo] and lo.releasing


def test_kv_pressure_completes_every_request_with_preemptions_and_no_refusals():
    """Total context 3x the pool: everything finishes, in order of what fits, with preemptions only."""
    s = sched_with(capacity=8)
    reqs = [req(f"r{i}", prompt=6, max_tokens=10) for i in range(6)]   # each ends at 15 positions = 4 blocks
    for r in reqs:
        s.add(r)
    for _ in range(2000):
        if all(r.done for r in reqs):
            break
        batch = s.next_batch()
        for p in s.preempted:                      # the driver releases them; the stages answer at once
            s.released(p.id)
        s.preempted.clear()
        assert not s.impossible
        assert s.ledger.used <= 8
        if not batch:
            continue
        answer_frame(s, batch)
        for r in batch:
            if r.seq.finished:
                finish(s, r)
    assert all(r.done for r in reqs) and all(len(r.seq.output_ids) == 10 for r in reqs)
    assert s.figures.preemptions > 0 and s.ledger.used == 0


# --- the prefix cache, seen from the ledger ------------------------------------------------------------------------

SYSTEM = [10 + i for i in range(2 * B)]


def served(s: Scheduler, prompt: list[int]) -> Request:
    """A one-token request run to its end: its full blocks are cached in the ledger afterwards."""
    r = req("first", prompt=prompt, max_tokens=1)
    s.add(r)
    answer_frame(s, s.next_batch())
    finish(s, r)
    return r


def test_a_second_request_starts_from_the_cached_prefix_and_computes_only_the_rest():
    s = sched_with(capacity=16)
    a = served(s, SYSTEM + [1, 2])
    b = req("b", prompt=SYSTEM + [3], max_tokens=1)
    s.add(b)
    batch = s.next_batch()
    assert batch == [b] and b.cached == 2 * B and b.sent.position == 0
    assert list(b.sent.token_ids) == b.seq.all_ids                      # the whole context is stamped
    f = s.figures
    assert (f.prefix_queries, f.prefix_hits, f.prefix_hit_tokens) == (2, 1, 2 * B)
    assert f.computed_tokens == len(a.seq.prompt_ids) + 1


def test_the_last_token_is_always_computed_and_tenants_do_not_share():
    s = sched_with(capacity=16)
    served(s, SYSTEM)
    same = req("same", prompt=SYSTEM, max_tokens=1)          # all of it cached: the last block is recomputed
    other = req("other", prompt=SYSTEM + [1], max_tokens=1, seed=hash_seed("fp", "tenant-b"))
    s.add(same)
    s.add(other)
    s.next_batch()
    assert same.cached == 2 * B - 1 and other.cached == 0    # a whole block, then 3 of the next one's 4


def test_no_prefix_after_a_miss_or_a_rebuild_and_none_when_caching_is_off():
    s = sched_with(capacity=16, caching=False)
    served(s, SYSTEM + [1])
    b = req("b", prompt=SYSTEM + [1], max_tokens=1)
    s.add(b)
    s.next_batch()
    assert b.cached == 0 and s.figures.prefix_queries == 0
    s2 = sched_with(capacity=16)
    served(s2, SYSTEM + [1])
    c = req("c", prompt=SYSTEM + [1], max_tokens=1)
    c.no_prefix = True
    s2.add(c)
    s2.next_batch()
    assert c.cached == 0


def test_ledger_registers_what_the_stages_register():
    """Same chain keys, same order of full blocks, same rule for a block after a private one."""
    led = BlockLedger(16, B, True)
    ids = SYSTEM + [1, 2, 3, 4]
    keys = block_keys(SEED, ids, B)
    led.hold("a", len(ids))
    led.register("a", SEED, ids, [k for _, k in keys], 0)
    assert [led.pool.lookup(k) for k in keys] == led.held["a"][:3]
    led.hold("b", len(ids))                                   # a twin computed the same blocks privately
    led.register("b", SEED, ids, [k for _, k in keys], 0)
    assert all(led.pool.entry(bl) is None for bl in led.held["b"])
    assert led.cached_prefix(SEED, ids + [9]) == PrefixHit(led.held["a"][:3])


def test_a_context_sharing_part_of_a_block_copies_it_and_leaves_it_cached():
    s = sched_with(capacity=16)
    a = served(s, SYSTEM + [1, 2, 3, 4])                     # three full blocks cached: the last one [1, 2, 3, 4]
    third = s.ledger.pool.lookup(block_keys(SEED, a.seq.all_ids[:3 * B], B)[2])
    b = req("b", prompt=SYSTEM + [1, 2, 7], max_tokens=1)
    s.add(b)
    assert s.next_batch() == [b]
    assert b.cached == 2 * B + 2 and len(b.sent.token_ids) == 2 * B + 3   # only the 7 is computed
    held = s.ledger.held["b"]
    assert len(held) == 3 and held[2] != third                # the copy goes into a block of b's own
    assert s.ledger.pool.refs.get(third) is None and third in s.ledger.pool.evictable   # let go, still cached
    assert s.figures.prefix_hit_tokens == 2 * B + 2
    # a context that differs inside the shared part finds only its whole blocks
    assert s.ledger.cached_prefix(SEED, SYSTEM + [8, 9, 9]) == PrefixHit(s.ledger.pool.match(
        block_keys(SEED, SYSTEM, B)))
    # nor does a context of another tenant, or one whose block before differs
    assert not s.ledger.cached_prefix(hash_seed("fp", "tenant-b"), SYSTEM + [1, 2, 7])
    assert s.ledger.cached_prefix(SEED, [99] * B + [1, 2, 7]) == PrefixHit()


def test_a_block_being_copied_from_is_never_the_one_evicted_for_the_copy():
    s = sched_with(capacity=3)
    a = served(s, SYSTEM + [1, 2, 3, 4])                      # 3 blocks, all cached and evictable, none free
    first, second, third = s.ledger.pool.match(block_keys(SEED, a.seq.all_ids[:3 * B], B))
    c = req("c", prompt=SYSTEM[:B + 2] + [5], max_tokens=1)   # the first block whole, then 2 of the second
    s.add(c)
    assert s.next_batch() == [c] and c.cached == B + 2
    assert s.ledger.held["c"] == [first, third]               # the third was the only one it could evict
    assert s.ledger.pool.counters.evictions == 1 and second in s.ledger.pool.evictable
    # with the source the only cached block left, a context needing a new block must wait
    d = req("d", prompt=SYSTEM[:B + 2] + [6], max_tokens=1)
    assert not s.ledger.can_hold(d.id, 7, s.ledger.cached_prefix(SEED, d.seq.all_ids))
