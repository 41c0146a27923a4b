"""The twin frame of issue 23: two same-tenant twins whose stamps end at the same context but start at different
positions (one decodes 1 token at position p, the other, rebuilt, replays p+1 tokens from 0), their stamps
swapped on the way to stage 1 while the rows stay (the `swap_slots` fault). Before the payload digest bound each
slot's MAC and row layout, the frame passed: every stamp's MAC is valid and the twins' context hashes equal, so
stage 1 sliced the rows by the swapped lengths, committed wrong KV (registering it in the prefix cache) and
sampled wrong tokens. Now it is refused whole, DIGEST_MISMATCH, and the stage is exactly as it was
(StageWorker.process on real frames through a 2-stage split of the tiny model, no gRPC)."""

from __future__ import annotations

import pytest
import torch

from services.stage_worker.worker import StageWorker
from tether import reference, settings
from tether.model.loader import load_slice, resolve_model
from tether.protocol.hashing import context_hash, hash_seed, sampling_digest
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

KEY = StampKey(bytes(range(32)))   # the pipeline's stamp key, as a handshake would set it
RejectReason = stage_pb2.RejectReason
BLOCK = settings.ATTENTION_BLOCK
PARAMS = reference.sampling_params(max_tokens=8, ignore_eos=True)
# Twin A holds BLOCK - 1 tokens and decodes its next one: both twins' commits would fill (and register) block 0.
PROMPT = [(11 * i + 5) % 250 + 1 for i in range(BLOCK - 1)]
OTHER = [(3 * i + 7) % 250 + 1 for i in range(9)]


@pytest.fixture(scope="module")
def slices():
    folder = resolve_model("tiny")
    return load_slice(folder, 0, 2, settings.DTYPE), load_slice(folder, 2, 4, settings.DTYPE)   # as the reference


def seed() -> int:
    return hash_seed(reference.load("tiny").fingerprint, "")   # one tenant: the twins share the chain


def slot(rid: str, ids: list[int], position: int, epoch: int = 1) -> stage_pb2.Slot:
    stamp = stage_pb2.Stamp(request_id=rid, epoch=epoch, position=position, token_ids=ids[position:],
                            parent_hash=context_hash(seed(), ids[:position]), context_hash=context_hash(seed(), ids),
                            sampling_digest=sampling_digest(PARAMS))
    return stage_pb2.Slot(stamp=stamp, sampling=PARAMS, sample=True, hash_seed=seed())


def frame(*slots: stage_pb2.Slot) -> stage_pb2.Frame:
    f = stage_pb2.Frame(stream_seq=1, pipeline_epoch=7, slots=list(slots))
    KEY.seal(f)
    return f


def snapshot(w: StageWorker):
    """Everything a refused frame must leave alone: request states, the KV bits, the block pool and its
    prefix-cache registrations."""
    a, pool = w.arena, w.arena.pool
    states = {rid: (s.epoch, s.length, s.hasher.value, s.kv_tag, s.kv.length, list(s.kv.blocks), list(s.tokens),
                    list(s.block_ends)) for rid, s in w.state.requests.items()}
    kv = [t.clone() for t in (*a.k, *a.v, a.owner)]
    cache = (dict(pool.refs), list(pool.free), dict(pool.cached),
             {b: (e.key, e.serial, e.info) for b, e in pool.entries.items()}, list(pool.evictable), pool.fresh)
    return states, kv, cache


def same(a, b) -> bool:
    (sa, ka, ca), (sb, kb, cb) = a, b
    return sa == sb and ca == cb and len(ka) == len(kb) and all(torch.equal(x, y) for x, y in zip(ka, kb))


def test_swapped_twin_stamps_are_refused_and_stage_1_is_left_as_it_was(slices):
    w0, w1 = StageWorker(slices[0], 0, 4096, stamp_key=KEY), StageWorker(slices[1], 1, 4096, stamp_key=KEY)
    # Twin A and an unrelated request C prefill; A samples its first token.
    setup = frame(slot("a", PROMPT, 0), slot("c", OTHER, 0))
    results = {r.stamp.request_id: r for r in w1.process(w0.process(setup).forward).results}
    assert all(r.ok for r in results.values())
    context = PROMPT + [results["a"].token_id]          # BLOCK tokens: what both twins' stamps end at
    other = OTHER + [results["c"].token_id]
    # The twin frame: B (rebuilt, a new epoch: replays the whole context from 0), C between them, A decoding.
    b, c, a = slot("b", context, 0, epoch=2), slot("c", other, len(OTHER)), slot("a", context, len(PROMPT))
    assert b.stamp.context_hash == a.stamp.context_hash and b.stamp.position != a.stamp.position
    out0 = w0.process(frame(b, c, a))
    assert out0.forward is not None and [s.stamp.request_id for s in out0.forward.slots] == ["b", "c", "a"]
    swapped = stage_pb2.Frame()
    swapped.CopyFrom(out0.forward)
    first, last = stage_pb2.Stamp(), stage_pb2.Stamp()
    first.CopyFrom(swapped.slots[0].stamp)
    last.CopyFrom(swapped.slots[2].stamp)
    swapped.slots[0].stamp.CopyFrom(last)                # the rows stay: BLOCK of B's, 1 of C's, 1 of A's
    swapped.slots[2].stamp.CopyFrom(first)
    assert all(KEY.verify(s) for s in swapped.slots), "each stamp's MAC is still valid: only its place moved"
    before = snapshot(w1)
    out1 = w1.process(swapped)
    assert out1.forward is None
    assert [(r.stamp.request_id, r.ok, RejectReason.Name(r.reason)) for r in out1.results] == \
           [(rid, False, "DIGEST_MISMATCH") for rid in ("a", "c", "b")], out1.results
    assert same(snapshot(w1), before), "a refused frame changed stage 1's state, KV or prefix cache"
    # The frame as stage 0 sent it goes through, and both twins sample what a request alone would.
    out1 = {r.stamp.request_id: r for r in w1.process(out0.forward).results}
    assert all(r.ok and r.has_token for r in out1.values())
    lm = reference.load("tiny")
    expected = list(reference.generate_ids(lm, PROMPT, PARAMS).output_ids)[:2]
    assert [results["a"].token_id, out1["a"].token_id] == expected
    assert out1["b"].token_id == out1["a"].token_id
