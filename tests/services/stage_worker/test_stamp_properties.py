"""Properties of the stage's guards, over arbitrary input (hypothesis).

1. StageState.check accepts exactly the slots whose position, epoch and hash chain are consistent with what
   the stage holds (and whose KV is its own), and a rejection never changes any state.
2. Decoding what comes off the wire (Frame.FromString, tensors.decode) raises nothing but the documented
   errors (google.protobuf.message.DecodeError, tensors.BadTensor) on arbitrary bytes.
3. StageWorker.process never raises on arbitrary frames, and a request none of whose slots was admitted
   keeps exactly the state it had.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.stage_worker.state import Rejected, StageState
from services.stage_worker.unchecked import UncheckedStageState
from services.stage_worker.worker import StageWorker, frame_digest
from tether.kv.paged import BlockArena, PagedKV
from tether.model.loader import load_slice, resolve_model
from tether.protocol import tensors
from tether.protocol.hashing import context_hash, hash_seed
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

KEY = StampKey(bytes(range(32)))   # the pipeline's stamp key, as a handshake would set it

RejectReason = stage_pb2.RejectReason
SEEDS = [hash_seed("fp", ""), hash_seed("fp", "tenant-b")]
RIDS = ["a", "b", "c"]
MAX_CONTEXT = 16
PROPS = settings(max_examples=300, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# --- 1. StageState.check against an independent model of what the stage holds --------------------------------
@dataclass
class Held:
    epoch: int
    seed: int
    tokens: list[int]
    kv_owner: str           # whose KV buffers this request's state points at (the test may cross them)
    kv_tag: int             # the context hash those buffers are tagged with (the test may bend it)

    @property
    def kv_ok(self) -> bool:
        return self.kv_tag == context_hash(self.seed, self.tokens)


@dataclass
class Oracle:
    held: dict[str, Held] = field(default_factory=dict)

    def accepts(self, slot: stage_pb2.Slot) -> bool:
        s = slot.stamp
        tokens = list(s.token_ids)
        if not s.request_id or not tokens or s.position + len(tokens) > MAX_CONTEXT:
            return False
        h = self.held.get(s.request_id)
        if h is not None and s.epoch < h.epoch:
            return False
        if h is not None and s.epoch > h.epoch:
            if s.position != 0:
                return False
            h = None                       # a rebuild starts over
        if h is None:
            history, kv_ok = [], True
            if s.position != 0:
                return False
        else:
            if s.position != len(h.tokens) or slot.hash_seed != h.seed:
                return False
            history, kv_ok = h.tokens, h.kv_ok and h.kv_owner == s.request_id
        return (s.parent_hash == context_hash(slot.hash_seed, history)
                and s.context_hash == context_hash(slot.hash_seed, history + tokens) and kv_ok)

    def commit(self, slot: stage_pb2.Slot) -> None:
        s = slot.stamp
        h = self.held.get(s.request_id)
        history = h.tokens if h is not None and s.epoch == h.epoch else []
        tokens = history + list(s.token_ids)
        self.held[s.request_id] = Held(s.epoch, slot.hash_seed, tokens, s.request_id,
                                       context_hash(slot.hash_seed, tokens))


tokens_st = st.lists(st.integers(0, 9), min_size=0, max_size=5)


@st.composite
def slot_for(draw, oracle: Oracle) -> stage_pb2.Slot:
    """Mostly near-valid slots (a consistent continuation or rebuild, then maybe one thing bent)."""
    rid = draw(st.sampled_from(RIDS))
    h = oracle.held.get(rid)
    tokens = draw(tokens_st)
    if h is not None and draw(st.booleans()):
        epoch, seed, history = h.epoch, h.seed, list(h.tokens)          # continue what is held
    else:
        epoch = draw(st.integers(0, 4))
        seed, history = draw(st.sampled_from(SEEDS)), []                 # start (or rebuild) at 0
    position, parent, context = len(history), context_hash(seed, history), context_hash(seed, history + tokens)
    slot_seed = seed
    bend = draw(st.sampled_from(["none"] * 4 + ["position", "parent", "context", "epoch", "seed", "tokens",
                                                 "history", "rid", "random"]))
    if bend == "position":
        position = max(0, position + draw(st.integers(-3, 3)))
    elif bend == "parent":
        parent ^= 1 << draw(st.integers(0, 63))
    elif bend == "context":
        context ^= 1 << draw(st.integers(0, 63))
    elif bend == "epoch":
        epoch = max(0, epoch + draw(st.integers(-2, 2)))
    elif bend == "seed":
        slot_seed = SEEDS[1 - SEEDS.index(seed)]
    elif bend == "tokens":
        tokens = draw(tokens_st)                                         # hashes no longer cover them
    elif bend == "history" and history:
        other = list(history)
        other[draw(st.integers(0, len(other) - 1))] += 1
        parent, context = context_hash(seed, other), context_hash(seed, other + tokens)
    elif bend == "rid":
        rid = draw(st.sampled_from(["", *RIDS]))
    elif bend == "random":
        position = draw(st.integers(0, MAX_CONTEXT + 2))
        parent, context = draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 2**64 - 1))
    stamp = stage_pb2.Stamp(request_id=rid, epoch=epoch, position=position, token_ids=tokens,
                            parent_hash=parent, context_hash=context)
    return stage_pb2.Slot(stamp=stamp, hash_seed=slot_seed)


class Stage:
    def __init__(self, state: type[StageState] = StageState) -> None:
        self.arena = BlockArena(2, 1, 4, torch.float32, 4, 100_000 // 4)
        self.state = state(lambda owner: PagedKV(self.arena, owner), MAX_CONTEXT)

    def snapshot(self):
        return self.arena.used_blocks, {
            rid: (id(s), s.epoch, s.length, s.hasher.seed, s.hasher.value, s.kv_tag, id(s.kv), s.kv.owner,
                  s.kv.length, s.kv.capacity)
            for rid, s in self.state.requests.items()}


@PROPS
@given(data=st.data())
def test_check_accepts_exactly_the_consistent_slots_and_rejection_changes_nothing(data):
    stage, oracle = Stage(), Oracle()
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["slot"] * 8 + ["cross", "retag"]))
        held = [r for r in RIDS if r in stage.state.requests]
        if op == "cross" and len(held) >= 2:   # a block table crossed between requests inside the stage
            a, b = data.draw(st.permutations(held))[:2]
            sa, sb = stage.state.requests[a], stage.state.requests[b]
            sa.kv, sb.kv = sb.kv, sa.kv
            sa.kv_tag, sb.kv_tag = sb.kv_tag, sa.kv_tag    # the tags travel with the buffers
            ha, hb = oracle.held[a], oracle.held[b]
            (ha.kv_owner, ha.kv_tag), (hb.kv_owner, hb.kv_tag) = (hb.kv_owner, hb.kv_tag), (ha.kv_owner, ha.kv_tag)
            continue
        if op == "retag" and held:             # a KV tag that no longer matches the chain
            r = data.draw(st.sampled_from(held))
            stage.state.requests[r].kv_tag ^= 1
            oracle.held[r].kv_tag ^= 1
            continue
        slot = data.draw(slot_for(oracle))
        expected = oracle.accepts(slot)
        before = stage.snapshot()
        try:
            a = stage.state.check(slot)
        except Rejected as e:
            event(f"rejected {RejectReason.Name(e.reason)}")
            assert not expected, f"rejected a consistent slot: {RejectReason.Name(e.reason)} {e.detail}"
            assert stage.snapshot() == before, "a rejection changed the stage's state"
            continue
        event("accepted")
        assert expected, f"accepted an inconsistent slot {slot}"
        a.state.kv.ensure(a.position + len(a.token_ids))
        stage.state.commit(a)
        oracle.commit(slot)
        h, s = oracle.held[slot.stamp.request_id], stage.state.requests[slot.stamp.request_id]
        assert (s.epoch, s.length, s.hasher.value, s.kv_tag, s.kv.owner, s.kv.length) == \
               (h.epoch, len(h.tokens), context_hash(h.seed, h.tokens), context_hash(h.seed, h.tokens),
                slot.stamp.request_id, len(h.tokens))


@PROPS
@given(slots=st.lists(st.builds(
    lambda rid, pos, toks, epoch, p, c, seed: stage_pb2.Slot(
        stamp=stage_pb2.Stamp(request_id=rid, epoch=epoch, position=pos, token_ids=toks, parent_hash=p,
                              context_hash=c), hash_seed=seed),
    st.sampled_from(["", *RIDS]), st.integers(0, 2**32 - 1), st.lists(st.integers(0, 2**32 - 1), max_size=4),
    st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    max_size=20))
def test_unchecked_mode_admits_without_raising_on_anything_within_the_window(slots):
    """--unsafe-disable-stamp-checks: no stamp check, but still only well-formed slots, and no exception."""
    stage = Stage(UncheckedStageState)
    for slot in slots:
        s = slot.stamp
        well_formed = bool(s.request_id) and len(s.token_ids) > 0 and s.position + len(s.token_ids) <= MAX_CONTEXT
        try:
            a = stage.state.check(slot)
        except Rejected as e:
            assert not well_formed and e.reason == RejectReason.BAD_FRAME
            continue
        assert well_formed
        a.state.kv.ensure(a.position + len(a.token_ids))
        stage.state.commit(a)
        assert a.state.kv.length == a.position + len(a.token_ids) <= a.state.kv.capacity


# --- 2. decoding arbitrary bytes -----------------------------------------------------------------------------
def _valid_frame_bytes() -> bytes:
    seed = SEEDS[0]
    slots = [stage_pb2.Slot(stamp=stage_pb2.Stamp(request_id=f"r{i}", epoch=1, position=0, token_ids=[1, 2],
                                                  parent_hash=context_hash(seed, []),
                                                  context_hash=context_hash(seed, [1, 2])), hash_seed=seed)
             for i in range(2)]
    f = stage_pb2.Frame(stream_seq=3, pipeline_epoch=5, slots=slots,
                        activations=tensors.encode(torch.ones(4, 8)))
    KEY.seal(f)
    return f.SerializeToString()


VALID = _valid_frame_bytes()


@st.composite
def wire_bytes(draw) -> bytes:
    """Arbitrary bytes, or a valid frame's bytes truncated, extended, or with bytes overwritten."""
    kind = draw(st.sampled_from(["random", "truncate", "mutate", "append"]))
    if kind == "random":
        return draw(st.binary(max_size=600))
    if kind == "truncate":
        return VALID[:draw(st.integers(0, len(VALID)))]
    if kind == "append":
        return VALID + draw(st.binary(min_size=1, max_size=40))
    b = bytearray(VALID)
    for _ in range(draw(st.integers(1, 8))):
        b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
    return bytes(b)


def decode_activations(frame: stage_pb2.Frame, width: int, dtype: str):
    rows = sum(len(s.stamp.token_ids) for s in frame.slots)
    return tensors.decode(frame.activations, rows=rows, width=width, dtype=dtype)


@settings(max_examples=1500, deadline=None, database=None)
@given(raw=wire_bytes(), dtype=st.sampled_from(sorted(tensors.WIRE_DTYPES)))
def test_frame_decoding_raises_only_documented_errors(raw, dtype):
    try:
        frame = stage_pb2.Frame.FromString(raw)
    except DecodeError:
        return
    try:
        t = decode_activations(frame, 8, dtype)
    except tensors.BadTensor:
        return
    assert t.dtype == tensors.WIRE_DTYPES[dtype] and bool(torch.isfinite(t).all())


@settings(max_examples=1500, deadline=None, database=None)
@given(wire_dtype=st.sampled_from(["float32", "bfloat16", "float16", "", "float64", "int8", "FLOAT32", "float32\0"]),
       shape=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 6), max_size=4),
       data=st.binary(max_size=200) | st.builds(lambda vals: struct.pack(f"<{len(vals)}f", *vals),
                                                  st.lists(st.floats(width=32), max_size=48)),
       rows=st.integers(0, 6), width=st.integers(1, 8), dtype=st.sampled_from(sorted(tensors.WIRE_DTYPES)))
def test_tensor_decoding_raises_only_bad_tensor(wire_dtype, shape, data, rows, width, dtype):
    msg = stage_pb2.Tensor(dtype=wire_dtype, shape=shape, data=data)
    try:
        t = tensors.decode(msg, rows=rows, width=width, dtype=dtype)
    except tensors.BadTensor:
        return
    assert tuple(t.shape) == (rows, width) and bool(torch.isfinite(t).all())
    assert wire_dtype == dtype and list(shape) == [rows, width]


# --- 3. the whole step on arbitrary frames --------------------------------------------------------------------
@pytest.fixture(scope="module")
def slices():
    folder = resolve_model("tiny")
    return {"full": load_slice(folder), "first": load_slice(folder, 0, 2), "tail": load_slice(folder, 2, 4)}


SEED = hash_seed("fp", "")


@st.composite
def hostile_frame(draw, hidden: int, vocab: int, held: dict[str, list[int]]):
    slots = []
    for _ in range(draw(st.integers(0, 4))):
        rid = draw(st.sampled_from(["", "p", "q", "r"]))
        history = held.get(rid, [])
        if draw(st.booleans()):   # consistent with what is held (maybe over out-of-vocabulary ids)
            toks = draw(st.lists(st.integers(0, vocab + 20), min_size=1, max_size=4))
            stamp = stage_pb2.Stamp(request_id=rid, epoch=1, position=len(history), token_ids=toks,
                                    parent_hash=context_hash(SEED, history),
                                    context_hash=context_hash(SEED, history + toks))
        else:
            stamp = stage_pb2.Stamp(request_id=rid, epoch=draw(st.integers(0, 3)), position=draw(st.integers(0, 9)),
                                    token_ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=4)),
                                    parent_hash=draw(st.integers(0, 2**64 - 1)),
                                    context_hash=draw(st.integers(0, 2**64 - 1)))
        # a cached prefix nobody holds, or one that leaves no rows, or one off the block grid
        cached = draw(st.sampled_from([0, 0, 0, 1, 64, 2**32 - 1]))
        slots.append(stage_pb2.Slot(stamp=stamp, hash_seed=SEED, sample=draw(st.booleans()), cached_prefix=cached))
    f = stage_pb2.Frame(stream_seq=1, pipeline_epoch=1, slots=slots)
    rows = sum(max(0, len(s.stamp.token_ids) - s.cached_prefix) for s in slots)
    acts = draw(st.sampled_from(["none", "good", "nan", "shape", "dtype", "bytes"]))
    if acts != "none":
        t = torch.randn(rows, hidden)
        if acts == "nan" and rows:
            t[draw(st.integers(0, rows - 1)), 0] = float("nan")
        msg = tensors.encode(t)
        if acts == "shape":
            msg.shape[:] = [rows + 1, hidden]
        elif acts == "dtype":
            msg.dtype = "float16"
        elif acts == "bytes":
            msg.data = msg.data[:-1]
        f.activations.CopyFrom(msg)
    KEY.seal(f)
    if not draw(st.integers(0, 5)):
        f.payload_digest = draw(st.integers(0, 2**64 - 1))
    if f.slots and not draw(st.integers(0, 5)):
        f.slots[0].stamp.mac = draw(st.integers(0, 2**64 - 1))
    return f


@pytest.mark.parametrize("which", ["full", "first", "tail"])
@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_process_never_raises_and_unadmitted_requests_keep_their_state(slices, which, data):
    model = slices[which]
    w = StageWorker(model, 0, 100_000, stamp_key=KEY)
    held = {"p": [5, 6, 7], "q": [8]}
    for rid, toks in held.items():   # some state to protect
        f = stage_pb2.Frame(stream_seq=1, pipeline_epoch=1, slots=[stage_pb2.Slot(
            stamp=stage_pb2.Stamp(request_id=rid, epoch=1, position=0, token_ids=toks,
                                  parent_hash=context_hash(SEED, []), context_hash=context_hash(SEED, toks)),
            hash_seed=SEED)])
        if not model.has_embedding:
            f.activations.CopyFrom(tensors.encode(torch.randn(len(toks), model.cfg.hidden_size)))
        KEY.seal(f)
        setup = w.process(f)
        assert all(r.ok for r in setup.results) and rid in w.state.requests
    frame = data.draw(hostile_frame(model.cfg.hidden_size, model.cfg.vocab_size, held))

    def snap(rid):
        s = w.state.requests.get(rid)
        return None if s is None else (s.epoch, s.length, s.hasher.value, s.kv_tag, s.kv.length, id(s.kv))
    before = {rid: snap(rid) for rid in ["", "p", "q", "r"]}
    used = w.kv_used_tokens()
    out = w.process(frame)                     # must not raise
    admitted = {r.stamp.request_id for r in out.results if r.ok}
    if out.forward is not None:                # a stage without the head forwards what it admitted
        admitted |= {s.stamp.request_id for s in out.forward.slots}
        assert out.forward.payload_digest == frame_digest(out.forward, KEY)
    for rid, b in before.items():
        if rid not in admitted:
            assert snap(rid) == b, f"{rid} was not admitted but its state changed"
    if not admitted:
        assert w.kv_used_tokens() == used
    for r in out.results:
        if not r.ok:
            assert r.reason != RejectReason.REJECT_REASON_NONE and r.detail
    assert len(out.results) + (len(out.forward.slots) if out.forward is not None else 0) == len(frame.slots)
