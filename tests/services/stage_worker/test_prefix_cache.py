"""The stage's prefix cache: a hit gives exactly the bits of a cold prefill, a hit is confirmed by token ids
(never the key alone), tenants never share blocks, and cached blocks are evicted only when the pool needs
room (StageWorker.process on real frames through a 2-stage split of the tiny model, no gRPC)."""

from __future__ import annotations

import pytest
import torch

from services.stage_worker import state as state_module
from services.stage_worker.worker import StageWorker
from tether import reference, settings
from tether.model.loader import load_slice, resolve_model
from tether.protocol import tensors
from tether.protocol.hashing import context_hash, hash_seed, sampling_digest
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

KEY = StampKey(bytes(range(32)))   # the pipeline's stamp key, as a handshake would set it

RejectReason = stage_pb2.RejectReason
BLOCK = settings.ATTENTION_BLOCK
SHARED = [(7 * i + 3) % 250 + 1 for i in range(2 * BLOCK)]      # two full blocks of a "system prompt"
PARAMS = reference.sampling_params(max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def slices():
    folder = resolve_model("tiny")
    return load_slice(folder, 0, 2, settings.DTYPE), load_slice(folder, 2, 4, settings.DTYPE)   # as the reference


def seed_of(tenant: str = "") -> int:
    return hash_seed(reference.load("tiny").fingerprint, tenant)


class Pipe:
    def __init__(self, slices, capacity: int = 100_000) -> None:
        self.w = [StageWorker(slices[0], 0, capacity, stamp_key=KEY), StageWorker(slices[1], 1, capacity, stamp_key=KEY)]

    def run(self, *slots: stage_pb2.Slot) -> tuple[dict[str, stage_pb2.SlotResult], stage_pb2.Frame | None]:
        """One frame through both stages: every result by request id, and what stage 0 forwarded."""
        f = stage_pb2.Frame(stream_seq=1, pipeline_epoch=7, slots=list(slots))
        KEY.seal(f)
        out0 = self.w[0].process(f)
        results = list(out0.results)
        if out0.forward is not None:
            results += self.w[1].process(out0.forward).results
        return {r.stamp.request_id: r for r in results}, out0.forward

    def release(self, *rids: str) -> None:
        for w in self.w:
            w.state.release(list(rids))


def slot(rid: str, ids: list[int], cached: int = 0, tenant: str = "") -> stage_pb2.Slot:
    seed = seed_of(tenant)
    stamp = stage_pb2.Stamp(request_id=rid, epoch=1, position=0, token_ids=ids, parent_hash=context_hash(seed, []),
                            context_hash=context_hash(seed, ids), sampling_digest=sampling_digest(PARAMS))
    return stage_pb2.Slot(stamp=stamp, sampling=PARAMS, sample=True, hash_seed=seed, cached_prefix=cached)


def last_row(forward: stage_pb2.Frame, hidden: int) -> torch.Tensor:
    rows = forward.activations.shape[0]
    return tensors.decode(forward.activations, rows=rows, width=hidden, dtype=forward.activations.dtype)[-1]


def test_a_hit_gives_the_bits_of_a_cold_prefill(slices):
    hidden = slices[0].cfg.hidden_size
    warm = Pipe(slices)
    res, _ = warm.run(slot("a", SHARED + [11, 12]))
    assert res["a"].ok
    warm.release("a")                                   # its two full blocks stay, cached
    assert [w.arena.pool.used for w in warm.w] == [0, 0]
    assert [len(w.arena.pool.evictable) for w in warm.w] == [2, 2]
    prompt = SHARED + [42, 43, 44]
    res, fwd = warm.run(slot("b", prompt, cached=2 * BLOCK))
    assert res["b"].ok, (RejectReason.Name(res["b"].reason), res["b"].detail)
    assert fwd.activations.shape[0] == 3   # only the 3 uncached rows travel

    cold = Pipe(slices)
    res_cold, fwd_cold = cold.run(slot("b", prompt))
    assert torch.equal(last_row(fwd, hidden), last_row(fwd_cold, hidden))
    assert (res["b"].token_id, res["b"].token_hash) == (res_cold["b"].token_id, res_cold["b"].token_hash)
    assert res["b"].token_id == reference.generate_ids(reference.load("tiny"), prompt, PARAMS).output_ids[0]
    for w in warm.w:
        c = w.arena.pool.counters
        assert (c.queries, c.hits, c.hit_blocks, c.hit_tokens) == (1, 1, 2, 2 * BLOCK)
    # and b keeps decoding on the shared blocks (read-only) after the cached prefix
    held = warm.w[0].state.requests["b"]
    assert held.length == len(prompt) and held.kv.tags[:2] != [held.kv.serial] * 2


@pytest.mark.parametrize("whole,part", [(0, 30), (1, 20), (1, 1), (0, BLOCK - 1)])
def test_a_hit_on_part_of_a_block_gives_the_bits_of_a_cold_prefill(slices, whole, part):
    hidden = slices[0].cfg.hidden_size
    warm = Pipe(slices)
    res, _ = warm.run(slot("a", SHARED + [11, 12]))
    warm.release("a")
    cached = whole * BLOCK + part
    prompt = SHARED[:cached] + [42, 43, 44]
    res, fwd = warm.run(slot("b", prompt, cached=cached))
    assert res["b"].ok, (RejectReason.Name(res["b"].reason), res["b"].detail)
    assert fwd.activations.shape[0] == 3
    cold = Pipe(slices)
    res_cold, fwd_cold = cold.run(slot("b", prompt))
    assert torch.equal(last_row(fwd, hidden), last_row(fwd_cold, hidden))
    assert (res["b"].token_id, res["b"].token_hash) == (res_cold["b"].token_id, res_cold["b"].token_hash)
    for w, c in zip(warm.w, cold.w):
        assert (w.arena.pool.counters.hits, w.arena.pool.counters.hit_blocks) == (1, whole)
        assert w.arena.pool.counters.hit_tokens == cached
        held = w.state.requests["b"]
        assert held.kv.tags[whole] == held.kv.serial          # the copied part is in a block of b's own
        assert w.arena.pool.used == -(-len(prompt) // BLOCK) and len(w.arena.pool.evictable) == 2 - whole
        for layer in range(w.arena.num_layers):               # every key and value, copied or computed
            assert all(torch.equal(x, y) for x, y in zip(held.kv.gather(layer), c.state.requests["b"].kv.gather(layer)))
    # and b decodes on: its next step reads the copied positions like any others
    tok = res["b"].token_id
    seed = seed_of()
    stamp = stage_pb2.Stamp(request_id="b", epoch=1, position=len(prompt), token_ids=[tok],
                            parent_hash=context_hash(seed, prompt), context_hash=context_hash(seed, prompt + [tok]),
                            sampling_digest=sampling_digest(PARAMS))
    res, _ = warm.run(stage_pb2.Slot(stamp=stamp, sampling=PARAMS, sample=True, hash_seed=seed))
    expected = reference.generate_ids(reference.load("tiny"), prompt, reference.sampling_params(
        max_tokens=2, ignore_eos=True)).output_ids
    assert [tok, res["b"].token_id] == expected


def test_a_partial_hit_is_refused_when_the_tokens_differ_even_if_the_key_matches(slices, monkeypatch):
    pipe = Pipe(slices)
    res, _ = pipe.run(slot("a", SHARED + [1]))
    pipe.release("a")
    real_hash = state_module.context_hash
    monkeypatch.setattr(state_module, "context_hash", lambda seed, ids: real_hash(seed, SHARED[:len(ids)]))
    other = [t + 1 for t in SHARED[:30]]
    res, _ = pipe.run(slot("b", other + [1], cached=30))
    assert res["b"].reason == RejectReason.PREFIX_MISS and "30 tokens" in res["b"].detail
    assert "b" not in pipe.w[0].state.requests and pipe.w[0].arena.pool.used == 0
    res, _ = pipe.run(slot("c", SHARED[:30] + [1], cached=30))          # the right tokens: a hit
    assert res["c"].ok
    res, _ = pipe.run(slot("d", SHARED[:30] + [1], cached=30, tenant="globex"))   # another tenant: never
    assert res["d"].reason == RejectReason.PREFIX_MISS


def test_the_block_copied_from_is_held_until_the_copy_and_never_evicted_for_it(slices):
    pipe = Pipe(slices, capacity=BLOCK)                       # one block in all
    res, _ = pipe.run(slot("a", SHARED[:BLOCK]))
    assert res["a"].ok
    pipe.release("a")                                         # its block stays, cached: the pool's only one
    res, _ = pipe.run(slot("b", SHARED[:20] + [7], cached=20))
    assert res["b"].reason == RejectReason.NO_CAPACITY        # taking a block would evict the one to copy
    for w in pipe.w:
        pool = w.arena.pool
        assert pool.used == 0 and len(pool.evictable) == 1 and "b" not in w.state.requests
    pipe.release("a")
    res, _ = pipe.run(slot("c", SHARED[:BLOCK - 1] + [7], cached=BLOCK - 1))
    assert res["c"].reason == RejectReason.NO_CAPACITY


def test_a_block_filled_by_decode_is_cached_too(slices):
    pipe = Pipe(slices)
    prompt = SHARED[:BLOCK - 1]
    res, _ = pipe.run(slot("a", prompt))
    tok = res["a"].token_id
    seed = seed_of()
    # one decode step fills the first block
    stamp = stage_pb2.Stamp(request_id="a", epoch=1, position=BLOCK - 1, token_ids=[tok],
                            parent_hash=context_hash(seed, prompt), context_hash=context_hash(seed, prompt + [tok]),
                            sampling_digest=sampling_digest(PARAMS))
    res, _ = pipe.run(stage_pb2.Slot(stamp=stamp, sampling=PARAMS, sample=True, hash_seed=seed))
    assert res["a"].ok
    assert [len(w.arena.pool.entries) for w in pipe.w] == [1, 1]
    res, _ = pipe.run(slot("b", prompt + [tok, 5], cached=BLOCK))
    assert res["b"].ok, res["b"].detail


def test_a_hit_is_refused_when_the_tokens_differ_even_if_the_key_matches(slices, monkeypatch):
    pipe = Pipe(slices)
    res, _ = pipe.run(slot("a", SHARED + [1]))
    assert res["a"].ok
    pipe.release("a")
    real_keys = state_module.block_keys
    collide = lambda seed, ids, block: real_keys(seed, SHARED[:len(ids)], block)   # noqa: E731 - a stubbed hash
    monkeypatch.setattr(state_module, "block_keys", collide)
    other = [t + 1 for t in SHARED]
    res, _ = pipe.run(slot("b", other + [1], cached=2 * BLOCK))
    assert res["b"].reason == RejectReason.PREFIX_MISS and res["b"].stage_index == 0
    assert "b" not in pipe.w[0].state.requests
    assert pipe.w[0].arena.pool.counters.hits == 0 and pipe.w[0].rejections["PREFIX_MISS"] == 1
    # the same stub with the right tokens is a hit: the refusal came from the token comparison
    res, _ = pipe.run(slot("c", SHARED + [1], cached=2 * BLOCK))
    assert res["c"].ok


def test_tenants_never_share_a_block(slices, monkeypatch):
    pipe = Pipe(slices)
    res, _ = pipe.run(slot("a", SHARED + [1], tenant="acme"))
    assert res["a"].ok
    pipe.release("a")
    res, _ = pipe.run(slot("b", SHARED + [1], cached=2 * BLOCK, tenant="globex"))
    assert res["b"].reason == RejectReason.PREFIX_MISS
    # even a key forced to collide across tenants is refused: the block's seed is compared as well
    real_keys = state_module.block_keys
    monkeypatch.setattr(state_module, "block_keys", lambda seed, ids, block: real_keys(seed_of("acme"), ids, block))
    res, _ = pipe.run(slot("c", SHARED + [1], cached=2 * BLOCK, tenant="globex"))
    assert res["c"].reason == RejectReason.PREFIX_MISS
    assert pipe.w[0].arena.pool.counters.hits == 0
    res, _ = pipe.run(slot("d", SHARED + [1], cached=2 * BLOCK, tenant="acme"))
    assert res["d"].ok


def test_cached_blocks_are_evicted_least_recently_used_first_and_only_for_room(slices):
    pipe = Pipe(slices, capacity=4 * BLOCK)
    res, _ = pipe.run(slot("a", SHARED[:BLOCK] + [1]))                       # blocks: a0 (+ a tail)
    res2, _ = pipe.run(slot("b", SHARED[BLOCK:] + [2]))                      # b0 (+ b tail)
    assert res["a"].ok and res2["b"].ok
    pipe.release("a")
    pipe.release("b")                                                         # a0 older than b0
    pool = pipe.w[0].arena.pool
    assert len(pool.evictable) == 2 and pool.counters.evictions == 0
    res, _ = pipe.run(slot("c", [3] * (3 * BLOCK - 1)))                     # 3 blocks: 2 free + 1 evicted
    assert res["c"].ok and pool.counters.evictions == 1
    res, _ = pipe.run(slot("d", SHARED[:BLOCK] + [1], cached=BLOCK))
    assert res["d"].reason == RejectReason.PREFIX_MISS                                  # a0 was the least recently used
    pipe.release("c")
    res, _ = pipe.run(slot("e", SHARED[BLOCK:] + [2], cached=BLOCK))
    assert res["e"].ok                                                        # b0 survived


@pytest.mark.parametrize("cached,position,why", [(2 * BLOCK, 0, "below"),
                                                 (BLOCK, 3, "position 0")])
def test_a_malformed_cached_prefix_rejects_the_frame(slices, cached, position, why):
    pipe = Pipe(slices)
    s = slot("a", SHARED, cached=cached)
    s.stamp.position = position
    res, fwd = pipe.run(s)
    assert fwd is None and res["a"].reason in (RejectReason.BAD_FRAME,) and res["a"].stage_index == 0
    assert pipe.w[0].state.requests == {}
