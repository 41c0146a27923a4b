"""Any alteration of a frame that changes what some slot computes on is refused (issue 23, docs/PROTOCOL.md
"Every field on the wire").

A well-formed, signed frame (decodes of held requests, a chunk, a new prompt, and a twin that replays a held
request's context from 0: the same context end at another position) is altered by a peer without the key in
one of the ways the wire allows: stamps, ids or whole slots moved, a token moved from one slot to another, one
field of one slot or of the tensor bent, rows shifted, a slot dropped or duplicated, the digest guessed. The same
stage (a fresh StageWorker, same state) runs the frame as sent and the frame as altered. The oracle is what was
computed, not which check fired: every slot the altered run admits must compute exactly what it computes in the
original run (its request's chain, epoch and length afterwards, its KV bit for bit, the rows it forwards or the
token and token hash it samples), and every request it does not admit keeps exactly the state it had.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.stage_worker.worker import StageWorker
from tether import reference
from tether.model.loader import load_slice, resolve_model
from tether.protocol import tensors
from tether.protocol.hashing import context_hash, hash_seed, sampling_digest
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

KEY = StampKey(bytes(range(32)))   # the pipeline's stamp key, as a handshake would set it
SEED = hash_seed("fp", "")
OTHER_SEED = hash_seed("fp", "tenant-b")
GREEDY = reference.sampling_params(max_tokens=8, ignore_eos=True)
SAMPLED = reference.sampling_params(max_tokens=8, temperature=0.9, seed=4, ignore_eos=True)
# What the stage holds before the frame: request -> its context so far.
HELD = {"p": [5, 9, 14, 3, 22], "q": [40, 41, 42]}
NEXT = {"p": [31], "q": [17, 18]}          # what the frame feeds them
NEW = [60, 61, 62, 63]                     # a new request's prompt
PROPS = settings(max_examples=150, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def slices():
    folder = resolve_model("tiny")
    return {"first": load_slice(folder, 0, 2), "tail": load_slice(folder, 2, 4)}


def slot(rid: str, history: list[int], feed: list[int], sample: bool, params=GREEDY, epoch: int = 1) -> stage_pb2.Slot:
    stamp = stage_pb2.Stamp(request_id=rid, epoch=epoch, position=len(history), token_ids=feed,
                            parent_hash=context_hash(SEED, history), context_hash=context_hash(SEED, history + feed),
                            sampling_digest=sampling_digest(params))
    return stage_pb2.Slot(stamp=stamp, sampling=params, sample=sample, hash_seed=SEED)


def rows(model, n: int, seed: int) -> stage_pb2.Tensor | None:
    if model.has_embedding:
        return None
    g = torch.Generator().manual_seed(seed)
    return tensors.encode(torch.randn(n, model.cfg.hidden_size, generator=g))


def sealed(slots, acts: stage_pb2.Tensor | None) -> stage_pb2.Frame:
    f = stage_pb2.Frame(stream_seq=1, pipeline_epoch=7, slots=slots)
    if acts is not None:
        f.activations.CopyFrom(acts)
    KEY.seal(f)
    return f


def worker(model) -> StageWorker:
    """A stage holding HELD (each request's setup frame run through it)."""
    w = StageWorker(model, 0, 8192, stamp_key=KEY)
    for i, (rid, ids) in enumerate(HELD.items()):
        out = w.process(sealed([slot(rid, [], ids, False)], rows(model, len(ids), 100 + i)))
        assert all(r.ok for r in out.results) and rid in w.state.requests
    return w


@st.composite
def frames(draw, model) -> stage_pb2.Frame:
    """A well-formed signed frame: p and q continue, r starts, twin t replays p's whole context from 0."""
    sample = lambda: draw(st.booleans())   # noqa: E731
    slots = [slot("p", HELD["p"], NEXT["p"], sample(), draw(st.sampled_from([GREEDY, SAMPLED]))),
             slot("q", HELD["q"], NEXT["q"], sample()),
             slot("r", [], NEW, sample()),
             slot("t", [], HELD["p"] + NEXT["p"], sample())]
    slots = draw(st.permutations(slots))[:draw(st.integers(2, 4))]
    n = sum(len(s.stamp.token_ids) for s in slots)
    return sealed(slots, rows(model, n, draw(st.integers(0, 2**16))))


def _copy(msg):
    out = type(msg)()
    out.CopyFrom(msg)
    return out


def _two(draw, f) -> tuple[int, int]:
    i, j = draw(st.permutations(range(len(f.slots))))[:2]
    return i, j


def _bend_slot(draw, f: stage_pb2.Frame) -> str:
    s = f.slots[draw(st.integers(0, len(f.slots) - 1))]
    what = draw(st.sampled_from(["position", "epoch", "token", "parent", "context", "sampling_digest", "mac",
                                 "hash_seed", "cached_prefix", "sample", "sampling", "request_id", "traceparent",
                                 "drop_token", "add_token"]))
    st_ = s.stamp
    if what == "position":
        st_.position = max(0, st_.position + draw(st.sampled_from([-1, 1])))
    elif what == "epoch":
        st_.epoch += draw(st.sampled_from([-1, 1]))
    elif what == "token":
        k = draw(st.integers(0, len(st_.token_ids) - 1))
        st_.token_ids[k] = (st_.token_ids[k] + 1) % 200
    elif what in ("parent", "context", "sampling_digest", "mac"):
        field = {"parent": "parent_hash", "context": "context_hash"}.get(what, what)
        setattr(st_, field, getattr(st_, field) ^ (1 << draw(st.integers(0, 63))))
    elif what == "hash_seed":
        s.hash_seed = OTHER_SEED
    elif what == "cached_prefix":
        s.cached_prefix = draw(st.sampled_from([1, 64]))
    elif what == "sample":
        s.sample = not s.sample
    elif what == "sampling":
        s.sampling.temperature = 0.5 if s.sampling.temperature == 0 else 0.0
    elif what == "request_id":
        st_.request_id = draw(st.sampled_from(["p", "q", "r", "t", "x"]))
    elif what == "traceparent":
        s.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    elif what == "drop_token" and len(st_.token_ids) > 1:
        del st_.token_ids[-1]
    else:
        st_.token_ids.append(7)
    return what


def alter(draw, f: stage_pb2.Frame) -> tuple[stage_pb2.Frame, str]:
    g = _copy(f)
    kind = draw(st.sampled_from(["swap_stamps", "swap_slots", "cross_ids", "move_token", "drop_slot", "duplicate_slot",
                                 "shift_rows", "flip_byte", "swap_rows", "tensor", "digest", "in_flight"]
                                + ["bend_slot"] * 8))
    i, j = _two(draw, g)
    if kind == "swap_stamps":             # the swap_slots fault: stamps move, everything else stays
        a, b = _copy(g.slots[i].stamp), _copy(g.slots[j].stamp)
        g.slots[i].stamp.CopyFrom(b)
        g.slots[j].stamp.CopyFrom(a)
    elif kind == "swap_slots":            # whole slots exchange places; the rows stay
        a, b = _copy(g.slots[i]), _copy(g.slots[j])
        g.slots[i].CopyFrom(b)
        g.slots[j].CopyFrom(a)
    elif kind == "cross_ids":
        si, sj = g.slots[i].stamp, g.slots[j].stamp
        si.request_id, sj.request_id = sj.request_id, si.request_id
    elif kind == "move_token":            # one token from one slot to another: the total row count stays
        src, dst = g.slots[i].stamp, g.slots[j].stamp
        if len(src.token_ids) > 1:
            dst.token_ids.append(src.token_ids.pop())
    elif kind == "bend_slot":
        kind = f"bend_slot:{_bend_slot(draw, g)}"
    elif kind == "drop_slot":
        del g.slots[i]
    elif kind == "duplicate_slot":
        g.slots.append(_copy(g.slots[i]))
    elif kind in ("shift_rows", "flip_byte", "swap_rows") and g.HasField("activations") and g.activations.data:
        data = bytearray(g.activations.data)
        width = len(data) // g.activations.shape[0]
        if kind == "shift_rows":
            data = data[width:] + data[:width]
        elif kind == "flip_byte":
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif g.activations.shape[0] >= 2:
            a, b = draw(st.permutations(range(g.activations.shape[0])))[:2]
            ra, rb = data[a * width:(a + 1) * width], data[b * width:(b + 1) * width]
            data[a * width:(a + 1) * width], data[b * width:(b + 1) * width] = rb, ra
        g.activations.data = bytes(data)
    elif kind == "tensor":
        what = draw(st.sampled_from(["dtype", "shape", "add"]))
        if what == "add" or not g.HasField("activations"):
            g.activations.CopyFrom(tensors.encode(torch.zeros(1, 4)))
        elif what == "dtype":
            g.activations.dtype = "float16"
        else:
            g.activations.shape[0] += 1
        kind = f"tensor:{what}"
    elif kind == "digest":
        g.payload_digest = draw(st.integers(0, 2**64 - 1))
    elif kind == "in_flight":             # the thread hint: any value, the same bits
        g.frames_in_flight = draw(st.sampled_from([0, 1, 2, 7]))
    return g, kind


def holds(w: StageWorker, rid: str):
    """What the stage holds for `rid`: epoch, length, chain, KV tag and the KV bits."""
    s = w.state.requests.get(rid)
    if s is None:
        return None
    kv = [torch.cat(s.kv.gather(layer)).clone() for layer in range(s.kv.arena.num_layers)]
    return s.epoch, s.length, s.hasher.value, s.kv_tag, s.kv.length, kv


def claim(x: stage_pb2.Slot) -> tuple:
    """What a forwarded slot claims for the next stage (its `sampling`, checked there against the stamp's digest,
    and its `traceparent`, telemetry, aside)."""
    return x.stamp.SerializeToString(deterministic=True), x.hash_seed, x.cached_prefix, x.sample


def computed(w: StageWorker, out, rid: str):
    """What `rid` computed in the step (`out`) and holds after it: chain, KV bits, forwarded rows or token."""
    held = holds(w, rid)
    sent = None
    if out.forward is not None:
        r, width = 0, w.model.cfg.hidden_size
        data = tensors.decode(out.forward.activations, rows=sum(len(x.stamp.token_ids) for x in out.forward.slots),
                              width=width, dtype=w.dtype)
        for x in out.forward.slots:
            n = len(x.stamp.token_ids)
            if x.stamp.request_id == rid:
                sent = (claim(x), data[r:r + n].clone())
            r += n
    token = next(((r.has_token, r.token_id, r.token_hash) for r in out.results if r.ok and r.stamp.request_id == rid),
                 None)
    return held, sent, token


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("which", ["first", "tail"])
@PROPS
@given(data=st.data())
def test_an_alteration_that_changes_what_a_slot_computes_on_is_refused(slices, which, data):
    model = slices[which]
    frame = data.draw(frames(model))
    altered, kind = alter(data.draw, frame)
    ref, w = worker(model), worker(model)
    before = {rid: holds(w, rid) for rid in "pqrtx"}
    want = ref.process(frame)
    assert all(r.ok for r in want.results) and (want.forward is None or len(want.forward.slots) == len(frame.slots))
    got = w.process(altered)
    admitted = {r.stamp.request_id for r in got.results if r.ok}
    if got.forward is not None:
        admitted |= {s.stamp.request_id for s in got.forward.slots}
        assert got.forward.payload_digest == KEY.frame_digest(got.forward.activations.data, got.forward.slots)
    event(f"{kind}: {'refused' if not admitted else 'admitted ' + str(len(admitted))}")
    for rid in "pqrtx":
        if rid in admitted:
            assert same(computed(w, got, rid), computed(ref, want, rid)), \
                f"{kind}: {rid} was admitted and computed something else than the frame as sent"
        else:
            assert same(holds(w, rid), before[rid]), f"{kind}: {rid} was refused but its state changed"
