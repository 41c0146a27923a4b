"""StageState: the per-slot stamp checks, commit / abandon, release and lease expiry (pure logic, no model)."""

from __future__ import annotations

import time

import pytest
import torch

from services.stage_worker.state import Admitted, Rejected, StageState
from tether import settings
from tether.kv.paged import BlockArena, PagedKV

BLOCK = settings.ATTENTION_BLOCK
from tether.protocol.hashing import context_hash, hash_seed
from tether.v1 import stage_pb2

RejectReason = stage_pb2.RejectReason
SEED = hash_seed("fp", "")
OTHER_SEED = hash_seed("fp", "other-tenant")
MAX_CONTEXT = 64


class Stage:
    """A StageState with a real KV arena, driven the way the worker drives it (check, ensure, commit)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.arena = BlockArena(2, 1, 4, torch.float32, BLOCK, capacity // BLOCK)
        self.state = StageState(lambda owner: PagedKV(self.arena, owner), MAX_CONTEXT)

    @property
    def used_tokens(self) -> int:
        return self.arena.used_blocks * BLOCK

    def admit(self, slot: stage_pb2.Slot) -> Admitted:
        a = self.state.check(slot)
        a.state.kv.ensure(a.position + len(a.token_ids))
        return a

    def step(self, slot: stage_pb2.Slot) -> Admitted:
        a = self.admit(slot)
        self.state.commit(a)
        return a

    def snapshot(self, rid: str):
        st = self.state.requests.get(rid)
        if st is None:
            return (None, self.used_tokens)
        return (st, st.epoch, st.length, st.hasher.value, st.kv_tag, st.kv.length, st.kv.capacity, st.kv.owner,
                self.used_tokens, dict(self.state.requests))


def slot(rid: str, tokens, history=(), epoch: int = 1, position: int | None = None, parent: int | None = None,
         context: int | None = None, seed: int = SEED) -> stage_pb2.Slot:
    """A well-formed slot extending `history` by `tokens`, with any field overridable."""
    history = list(history)
    stamp = stage_pb2.Stamp(
        request_id=rid, epoch=epoch, position=len(history) if position is None else position, token_ids=list(tokens),
        parent_hash=context_hash(seed, history) if parent is None else parent,
        context_hash=context_hash(seed, history + list(tokens)) if context is None else context)
    return stage_pb2.Slot(stamp=stamp, hash_seed=seed)


PROMPT = [5, 6, 7, 8]


@pytest.fixture
def stage() -> Stage:
    s = Stage()
    s.step(slot("a", PROMPT))
    return s


def test_good_slots_advance_the_chain(stage):
    st = stage.state.requests["a"]
    assert (st.length, st.epoch, st.kv.length) == (4, 1, 4)
    assert st.hasher.value == st.kv_tag == context_hash(SEED, PROMPT)
    assert stage.used_tokens == BLOCK                   # capacity is allocated in whole attention blocks
    stage.step(slot("a", [9], PROMPT))
    stage.step(slot("a", [10, 11], PROMPT + [9]))
    assert st.length == 7 and st.hasher.value == context_hash(SEED, PROMPT + [9, 10, 11])
    held = stage.state.held("a")
    assert held.held and (held.epoch, held.length, held.context_hash) == (1, 7, st.hasher.value)
    assert not stage.state.held("zzz").held


def reject(stage: Stage, s: stage_pb2.Slot, reason: int) -> str:
    """Check that `s` is rejected with `reason` and that the state it targets did not change at all."""
    before = stage.snapshot(s.stamp.request_id)
    with pytest.raises(Rejected) as e:
        stage.state.check(s)
    assert e.value.reason == reason, (RejectReason.Name(e.value.reason), e.value.detail)
    assert stage.snapshot(s.stamp.request_id) == before
    return e.value.detail


def test_unknown_request(stage):
    assert "no state for b" in reject(stage, slot("b", [1], PROMPT), RejectReason.UNKNOWN_REQUEST)
    assert "b" not in stage.state.requests


@pytest.mark.parametrize("position", [0, 2, 3, 5, 100 - 60])
def test_position_gap(stage, position):
    s = slot("a", [9], PROMPT[:position] if position <= 4 else PROMPT + [0] * (position - 4))
    assert "stage holds 4 tokens" in reject(stage, s, RejectReason.POSITION_GAP)


def test_state_mismatch_parent_hash(stage):
    s = slot("a", [9], PROMPT, parent=context_hash(SEED, PROMPT) ^ 1)
    assert "parent hash" in reject(stage, s, RejectReason.STATE_MISMATCH)
    # a different history of the same length: right position, wrong parent
    assert "parent hash" in reject(stage, slot("a", [9], [5, 6, 7, 0]), RejectReason.STATE_MISMATCH)


def test_state_mismatch_hash_seed(stage):
    """The same tokens under another tenant's seed are another context."""
    s = slot("a", [9], PROMPT)
    s.hash_seed = OTHER_SEED
    reject(stage, s, RejectReason.STATE_MISMATCH)
    reject(stage, slot("a", [9], PROMPT, seed=OTHER_SEED), RejectReason.STATE_MISMATCH)


def test_state_mismatch_context_hash(stage):
    s = slot("a", [9], PROMPT, context=context_hash(SEED, PROMPT + [10]))
    assert "context hash" in reject(stage, s, RejectReason.STATE_MISMATCH)
    # token ids swapped after the hashes were computed
    s = slot("a", [9, 10], PROMPT)
    s.stamp.token_ids[:] = [10, 9]
    assert "context hash" in reject(stage, s, RejectReason.STATE_MISMATCH)


def test_state_mismatch_on_a_fresh_request():
    stage = Stage()
    reject(stage, slot("n", [1, 2], parent=123), RejectReason.STATE_MISMATCH)
    reject(stage, slot("n", [1, 2], context=123), RejectReason.STATE_MISMATCH)
    assert stage.state.requests == {} and stage.used_tokens == 0


def test_stale_epoch(stage):
    stage.step(slot("a", PROMPT, epoch=3))                   # rebuilt at epoch 3
    assert "older than held epoch 3" in reject(stage, slot("a", [9], PROMPT, epoch=2), RejectReason.STALE_EPOCH)
    assert "older" in reject(stage, slot("a", PROMPT, epoch=1), RejectReason.STALE_EPOCH)


def test_new_epoch_must_start_at_zero(stage):
    assert "must start at position 0" in reject(stage, slot("a", [9], PROMPT, epoch=2), RejectReason.STALE_EPOCH)


def test_kv_tag_mismatch_by_corrupted_tag(stage):
    stage.state.requests["a"].kv_tag ^= 1
    assert "tagged for another context" in reject(stage, slot("a", [9], PROMPT), RejectReason.KV_TAG_MISMATCH)


def test_kv_tag_mismatch_by_foreign_owner(stage):
    """A KV buffer crossed between requests inside the stage is caught before it is used."""
    stage.step(slot("b", [1, 2, 3, 4]))
    a, b = stage.state.requests["a"], stage.state.requests["b"]
    a.kv, b.kv = b.kv, a.kv
    reject(stage, slot("a", [9], PROMPT), RejectReason.KV_TAG_MISMATCH)
    reject(stage, slot("b", [9], [1, 2, 3, 4]), RejectReason.KV_TAG_MISMATCH)
    a.kv.owner = "a"                                         # right owner, but a stale tag still fails
    a.kv_tag = context_hash(SEED, [1, 2, 3])
    reject(stage, slot("a", [9], PROMPT), RejectReason.KV_TAG_MISMATCH)


@pytest.mark.parametrize("bad", ["no id", "no tokens", "past the window"])
def test_bad_frame(stage, bad):
    if bad == "no id":
        s = slot("", [1])
    elif bad == "no tokens":
        s = slot("a", [], PROMPT)
    else:
        s = slot("a", [1] * (MAX_CONTEXT - 3), PROMPT)
    reject(stage, s, RejectReason.BAD_FRAME)


def test_window_boundary_is_inclusive(stage):
    stage.step(slot("a", [1] * (MAX_CONTEXT - 4), PROMPT))   # exactly fills the window
    assert stage.state.requests["a"].length == MAX_CONTEXT


def test_a_rejected_slot_leaves_others_alone(stage):
    stage.step(slot("b", [1, 2]))
    b_before = stage.snapshot("b")
    for s in (slot("a", [9], PROMPT, parent=1), slot("a", [9], PROMPT[:2]), slot("a", [9], PROMPT, epoch=0)):
        with pytest.raises(Rejected):
            stage.state.check(s)
    assert stage.snapshot("b") == b_before


def test_check_alone_changes_nothing(stage):
    """Admission is not commitment: a checked but never committed slot leaves the held state as it was."""
    before = stage.snapshot("a")
    a = stage.state.check(slot("a", [9], PROMPT))
    assert not a.fresh and a.state is stage.state.requests["a"]
    assert stage.snapshot("a") == before
    stage.state.abandon(a)                                   # not fresh: nothing to free
    assert stage.snapshot("a") == before


def test_new_epoch_frees_the_old_state_as_soon_as_its_slot_passes(stage):
    """A rebuild's replay never needs room the old epoch still holds (the coordinator's block ledger counts
    those blocks freed when it rebuilds)."""
    old = stage.state.requests["a"]
    used = stage.used_tokens
    rebuilt = PROMPT + [9, 10]
    a = stage.admit(slot("a", rebuilt, epoch=2))
    assert a.fresh and a.state is not old
    assert "a" not in stage.state.requests and old.kv.capacity == 0
    assert stage.used_tokens == used                      # the old buffers went back before the new ones
    stage.state.commit(a)
    new = stage.state.requests["a"]
    assert new is a.state and new.epoch == 2 and new.length == 6
    assert new.hasher.value == context_hash(SEED, rebuilt)
    # and the old epoch is now refused
    reject(stage, slot("a", [9], PROMPT, epoch=1), RejectReason.STALE_EPOCH)


def test_a_refused_new_epoch_keeps_the_old_state(stage):
    old = stage.state.requests["a"]
    before = stage.snapshot("a")
    reject(stage, slot("a", [1, 2, 3], epoch=2, context=123), RejectReason.STATE_MISMATCH)
    assert stage.snapshot("a") == before and stage.state.requests["a"] is old


def test_abandoned_new_epoch_leaves_nothing_held(stage):
    a = stage.admit(slot("a", [1, 2, 3], epoch=2))
    stage.state.abandon(a)
    assert "a" not in stage.state.requests and a.state.kv.capacity == 0
    assert stage.used_tokens == sum(st.kv.capacity for st in stage.state.requests.values())


def test_abandoned_fresh_request_frees_its_kv():
    stage = Stage()
    a = stage.admit(slot("n", [1, 2, 3]))
    assert a.fresh and stage.used_tokens == BLOCK
    stage.state.abandon(a)
    assert stage.used_tokens == 0 and "n" not in stage.state.requests


def test_release_frees_kv_back_to_the_pool(stage):
    stage.step(slot("b", list(range(20))))
    stage.step(slot("a", list(range(30)), PROMPT))           # growth reserves more
    assert stage.used_tokens > 0
    assert stage.state.release(["a", "b", "missing"]) == 2
    assert stage.used_tokens == 0 and stage.state.requests == {}
    assert stage.state.release(["a"]) == 0                   # idempotent
    reject(stage, slot("a", [9], PROMPT), RejectReason.UNKNOWN_REQUEST)


def test_lease_expiry_frees_only_idle_state(stage):
    now = time.monotonic()
    stage.state.requests["a"].last_used = now - 100
    stage.step(slot("b", [1, 2]))
    stage.state.requests["b"].last_used = now - 1
    assert stage.state.expire(lease_s=10, now=now) == ["a"]
    assert list(stage.state.requests) == ["b"] and stage.used_tokens == BLOCK
    assert stage.state.expire(lease_s=10, now=now + 20) == ["b"]
    assert stage.used_tokens == 0 and stage.state.requests == {}


def test_commit_refreshes_the_lease(stage):
    st = stage.state.requests["a"]
    st.last_used = time.monotonic() - 100
    stage.step(slot("a", [9], PROMPT))
    assert stage.state.expire(lease_s=10) == []
    assert "a" in stage.state.requests


def test_no_capacity_is_raised_by_the_pool():
    from tether.kv.blocks import NoCapacity

    stage = Stage(capacity=BLOCK + BLOCK // 2)
    stage.step(slot("a", [1] * 10))                          # reserves one block
    a = stage.state.check(slot("b", [1] * 10))
    with pytest.raises(NoCapacity):
        a.state.kv.ensure(10)
    stage.state.abandon(a)
    assert stage.used_tokens == BLOCK and list(stage.state.requests) == ["a"]
