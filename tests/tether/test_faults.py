"""tether.faults: spec parsing, determinism per seed, rates, and what each kind does to real Frames."""

from __future__ import annotations

import math

import pytest
import torch

from tether.faults import FOLLOWED, KINDS, FaultConfig, FaultInjector, FaultLedger, HeldFrames
from tether.protocol import tensors
from tether.protocol.hashing import context_hash
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

SEED = 12345
KEY = StampKey(bytes(range(32)))


def stamp(rid: str, tokens, history=(), epoch: int = 1) -> stage_pb2.Stamp:
    history = list(history)
    return stage_pb2.Stamp(request_id=rid, epoch=epoch, position=len(history), token_ids=list(tokens),
                           parent_hash=context_hash(SEED, history),
                           context_hash=context_hash(SEED, history + list(tokens)))


def make_frame(seq: int = 1, slots: int = 3, acts: bool = True, decode: bool = False) -> stage_pb2.Frame:
    ss = []
    for i in range(slots):
        history = [10 + i, 20 + i] if decode else []
        ss.append(stage_pb2.Slot(stamp=stamp(f"req-{i}", [30 + i] if decode else [1 + i, 2, 3], history),
                                 hash_seed=SEED, sample=True))
    f = stage_pb2.Frame(stream_seq=seq, pipeline_epoch=99, slots=ss)
    if acts:
        rows = sum(len(s.stamp.token_ids) for s in ss)
        f.activations.CopyFrom(tensors.encode(torch.arange(rows * 8, dtype=torch.float32).view(rows, 8)))
    KEY.seal(f)
    return f


def make_reply(n: int = 3) -> stage_pb2.FrameReply:
    return stage_pb2.FrameReply(stream_seq=4, results=[
        stage_pb2.SlotResult(stamp=stamp(f"req-{i}", [], [1, 2, i]), ok=True, has_token=True, token_id=100 + i)
        for i in range(n)])


def digest_ok(f: stage_pb2.Frame) -> bool:
    return f.payload_digest == KEY.frame_digest(f.activations.data, f.slots)


def chain_ok(s: stage_pb2.Stamp, history) -> bool:
    return s.context_hash == context_hash(SEED, list(history) + list(s.token_ids))


def only(kind: str, rate: float = 1.0, **params) -> FaultInjector:
    return FaultInjector(FaultConfig(rates={kind: rate}, **params))


def injected(inj: FaultInjector) -> dict[str, int]:
    return {k: v for k, v in inj.counts.items() if v}


# --- parsing -----------------------------------------------------------------------------------------------
def test_parse_full_spec():
    c = FaultConfig.parse(" drop=0.02, corrupt=0.05,delay=0.1,delay_ms=50,seed=7, ")
    assert c.rates == {"drop": 0.02, "corrupt": 0.05, "delay": 0.1}
    assert (c.seed, c.delay_ms, c.hold_ms, c.hold_s) == (7, 50.0, None, 0.1)
    assert c.enabled and c.rate("crash") == 0.0
    assert FaultConfig.parse(c.spec()) == c
    c2 = FaultConfig.parse("reorder=1,hold_ms=5,seed=0x10")
    assert (c2.seed, c2.hold_s) == (16, 0.005)
    assert FaultConfig.parse(c2.spec()) == c2


@pytest.mark.parametrize("spec", ["", "   ", None, ",", "drop=0", "drop=0,seed=3"])
def test_off_specs(spec):
    c = FaultConfig.parse(spec)
    assert not c.enabled
    inj = FaultInjector(c)
    f = make_frame()
    assert not inj.enabled and inj.outbound(f) == [f] and inj.reply(make_reply()) == make_reply()
    assert not inj.crash() and inj.forget(make_frame(decode=True)) is None and inj.delay_s() == 0.0
    assert sum(inj.counts.values()) == 0


@pytest.mark.parametrize("spec,needle", [
    ("dorp=0.1", "unknown fault 'dorp'"),
    ("drop=1.5", "must be in [0, 1]"),
    ("drop=-0.1", "must be in [0, 1]"),
    ("drop=nan", "must be in [0, 1]"),
    ("drop=lots", "must be a number"),
    ("drop", "not KEY=VALUE"),
    ("drop=", "not KEY=VALUE"),
    ("=0.1", "not KEY=VALUE"),
    ("drop=0.1,drop=0.2", "twice"),
    ("seed=1.5", "seed must be an integer"),
    ("delay_ms=-1", "must be >= 0"),
    ("delay_ms=inf", "must be >= 0"),
    ("hold_ms=soon", "number of milliseconds"),
])
def test_parse_errors_are_clear(spec, needle):
    with pytest.raises(ValueError) as e:
        FaultConfig.parse(spec)
    msg = str(e.value)
    assert needle in msg
    assert all(k in msg for k in KINDS), "the message lists the kinds"


def test_from_env():
    assert FaultConfig.from_env({"TETHER_FAULTS": "crash=0.5,seed=3"}) == FaultConfig(rates={"crash": 0.5}, seed=3)
    assert not FaultConfig.from_env({}).enabled
    with pytest.raises(ValueError):
        FaultConfig.from_env({"TETHER_FAULTS": "explode=1"})


# --- determinism and rates -----------------------------------------------------------------------------------
def run(inj: FaultInjector, frames: int = 300) -> list:
    """Drive every hook over a fixed sequence of frames; a transcript of what came out."""
    held = HeldFrames()
    out = []
    for seq in range(1, frames + 1):
        f = make_frame(seq, slots=1 + seq % 3, decode=seq % 2 == 0, acts=seq % 5 != 0)
        out.append(("crash", inj.crash()))
        out.append(("forget", inj.forget(f)))
        out.append(("delay", inj.delay_s()))
        out.append(("out", [g.SerializeToString() for g in inj.outbound(f, held)]))
        out.append(("reply", inj.reply(make_reply(1 + seq % 3)).SerializeToString()))
    out.append(("flush", [g.SerializeToString() for g in inj.flush(held)]))
    return out


SPEC = "drop=0.1,duplicate=0.1,reorder=0.1,delay=0.1,corrupt=0.1,swap_slots=0.1,cross_ids=0.1,forget_kv=0.1,crash=0.1"


def test_same_seed_same_faults_other_seed_other_faults():
    a, b = FaultInjector(FaultConfig.parse(SPEC + ",seed=7")), FaultInjector(FaultConfig.parse(SPEC + ",seed=7"))
    assert run(a) == run(b)
    assert a.counts == b.counts and all(a.counts[k] > 0 for k in KINDS)
    c = FaultInjector(FaultConfig.parse(SPEC + ",seed=8"))
    assert run(c) != run(a)


def test_a_kinds_decisions_do_not_depend_on_other_kinds_rates():
    def drops(spec: str) -> list[bool]:
        inj = FaultInjector(FaultConfig.parse(spec))
        return [inj.outbound(make_frame(i)) == [] for i in range(200)]
    assert drops("drop=0.3,seed=1") == drops("drop=0.3,corrupt=0.9,cross_ids=0.5,seed=1")


@pytest.mark.parametrize("kind,rate", [("drop", 0.02), ("drop", 0.3), ("delay", 0.1), ("crash", 0.05),
                                       ("duplicate", 0.5), ("corrupt", 0.2)])
def test_rates_are_respected(kind, rate):
    n = 20_000
    inj = only(kind, rate, seed=3)
    f = make_frame()
    for _ in range(n):
        if kind == "delay":
            inj.delay_s()
        elif kind == "crash":
            inj.crash()
        else:
            inj.outbound(f)
    sigma = math.sqrt(n * rate * (1 - rate))
    assert abs(inj.counts[kind] - n * rate) < 5 * sigma, inj.counts
    assert sum(inj.counts.values()) == inj.counts[kind]


# --- each kind on a real frame -------------------------------------------------------------------------------
def test_drop():
    inj = only("drop")
    f = make_frame()
    assert inj.outbound(f) == [] and injected(inj) == {"drop": 1}


def test_duplicate():
    inj = only("duplicate")
    f = make_frame(seq=5)
    out = inj.outbound(f)
    assert out == [f, f] and out[1] is not out[0] and all(g.stream_seq == 5 for g in out)
    assert injected(inj) == {"duplicate": 1}


def test_reorder_holds_a_frame_until_the_next_one():
    inj = only("reorder")
    held = HeldFrames()
    a, b, c = make_frame(1), make_frame(2), make_frame(3)
    assert inj.outbound(a, held) == [] and held
    assert [g.stream_seq for g in inj.outbound(b, held)] == [2, 1] and not held
    assert inj.outbound(c, held) == []          # held again (rate 1)
    assert [g.stream_seq for g in inj.flush(held)] == [3] and not held   # no successor came: sent late
    assert inj.flush(held) == []
    assert injected(inj) == {"reorder": 2}


def test_a_held_frame_still_goes_when_its_successor_is_dropped():
    inj = FaultInjector(FaultConfig(rates={"reorder": 1.0, "drop": 0.5}, seed=1))
    held = HeldFrames()
    sent, seq = [], 0
    while inj.counts["drop"] == 0 or inj.counts["reorder"] < 3:
        seq += 1
        sent += [g.stream_seq for g in inj.outbound(make_frame(seq), held)]
    sent += [g.stream_seq for g in inj.flush(held)]
    dropped = seq - len(sent)
    assert dropped == inj.counts["drop"] and sorted(sent) == sorted(set(sent))
    assert sent != sorted(sent)


def test_streams_have_separate_reorder_buffers():
    inj = only("reorder")
    h1, h2 = HeldFrames(), HeldFrames()
    assert inj.outbound(make_frame(1), h1) == [] and inj.outbound(make_frame(7), h2) == []
    assert [g.stream_seq for g in inj.outbound(make_frame(2), h1)] == [2, 1]
    assert [g.stream_seq for g in inj.outbound(make_frame(8), h2)] == [8, 7]


def test_delay():
    inj = only("delay", delay_ms=30)
    assert inj.delay_s() == pytest.approx(0.03)
    assert injected(inj) == {"delay": 1}
    f = make_frame()
    assert inj.outbound(f) == [f]           # a delay never changes what is sent


def test_corrupt_flips_one_activation_byte_and_breaks_the_digest():
    inj = only("corrupt", seed=5)
    f = make_frame()
    original = f.SerializeToString()
    (g,) = inj.outbound(f)
    assert f.SerializeToString() == original, "the caller's frame is never mutated"
    diff = [i for i, (x, y) in enumerate(zip(f.activations.data, g.activations.data)) if x != y]
    assert len(diff) == 1 and len(g.activations.data) == len(f.activations.data)
    assert list(g.slots) == list(f.slots) and g.payload_digest == f.payload_digest
    assert digest_ok(f) and not digest_ok(g)
    assert injected(inj) == {"corrupt": 1}


def test_corrupt_without_activations_changes_one_token_id_and_breaks_the_chain():
    inj = only("corrupt", seed=5)
    f = make_frame(acts=False)
    (g,) = inj.outbound(f)
    changed = [(i, j) for i, (s, t) in enumerate(zip(f.slots, g.slots))
               for j, (x, y) in enumerate(zip(s.stamp.token_ids, t.stamp.token_ids)) if x != y]
    assert len(changed) == 1
    i, _ = changed[0]
    s, t = f.slots[i].stamp, g.slots[i].stamp
    assert (t.parent_hash, t.context_hash, t.request_id, t.position) == \
           (s.parent_hash, s.context_hash, s.request_id, s.position)
    assert chain_ok(s, []) and not chain_ok(t, [])
    assert KEY.verify(f.slots[i]) and not KEY.verify(g.slots[i])   # the MAC binds the token ids themselves
    assert injected(inj) == {"corrupt": 1}


def test_corrupt_that_cannot_apply_is_not_counted():
    inj = only("corrupt")
    empty = stage_pb2.Frame(stream_seq=1)
    assert inj.outbound(empty) == [empty] and injected(inj) == {}


def test_swap_slots_exchanges_stamps_not_rows():
    inj = only("swap_slots", seed=2)
    f = make_frame(slots=3)
    (g,) = inj.outbound(f)
    swapped = [i for i in range(3) if g.slots[i].stamp != f.slots[i].stamp]
    assert len(swapped) == 2
    i, j = swapped
    assert g.slots[i].stamp == f.slots[j].stamp and g.slots[j].stamp == f.slots[i].stamp
    assert g.activations == f.activations
    assert [s.hash_seed for s in g.slots] == [s.hash_seed for s in f.slots]
    assert not digest_ok(g)     # the digest is seeded by the slots' hashes in order
    assert injected(inj) == {"swap_slots": 1}
    one = make_frame(slots=1)
    assert inj.outbound(one) == [one] and injected(inj) == {"swap_slots": 1}   # needs two slots


def test_cross_ids_exchanges_request_ids_only():
    inj = only("cross_ids", seed=2)
    f = make_frame(slots=3)
    (g,) = inj.outbound(f)
    moved = [i for i in range(3) if g.slots[i].stamp.request_id != f.slots[i].stamp.request_id]
    assert len(moved) == 2
    i, j = moved
    assert g.slots[i].stamp.request_id == f.slots[j].stamp.request_id
    for k in range(3):
        a, b = stage_pb2.Stamp(), stage_pb2.Stamp()
        a.CopyFrom(f.slots[k].stamp)
        b.CopyFrom(g.slots[k].stamp)
        a.request_id = b.request_id = ""
        assert a == b
    assert digest_ok(g) and g.activations == f.activations   # invisible to the digest: the stamps catch it
    assert KEY.verify(f.slots[i]) and not KEY.verify(g.slots[i]) and not KEY.verify(g.slots[j])   # their MACs
    assert injected(inj) == {"cross_ids": 1}


def test_forget_names_a_held_request():
    inj = only("forget_kv", seed=4)
    prefill = make_frame(decode=False)
    assert inj.forget(prefill) is None and injected(inj) == {}    # nothing a stage must hold yet
    decode = make_frame(decode=True)
    rid = inj.forget(decode)
    assert rid in {s.stamp.request_id for s in decode.slots}
    assert injected(inj) == {"forget_kv": 1}


def test_crash_only_decides():
    inj = only("crash")
    assert inj.crash() is True and injected(inj) == {"crash": 1}


def test_reply_cross_ids_and_corrupt():
    inj = only("cross_ids", seed=9)
    r = make_reply(3)
    g = inj.reply(r)
    assert r == make_reply(3), "the caller's reply is never mutated"
    moved = [i for i in range(3) if g.results[i].stamp.request_id != r.results[i].stamp.request_id]
    assert len(moved) == 2 and [x.token_id for x in g.results] == [x.token_id for x in r.results]
    assert injected(inj) == {"cross_ids": 1}
    assert inj.reply(make_reply(1)) == make_reply(1) and injected(inj) == {"cross_ids": 1}

    inj = only("corrupt", seed=9)
    g = inj.reply(r)
    changed = [i for i in range(3) if g.results[i].token_id != r.results[i].token_id]
    assert len(changed) == 1
    i = changed[0]
    assert g.results[i].token_id // 16 == r.results[i].token_id // 16     # stays in its vocabulary group
    assert g.results[i].stamp == r.results[i].stamp
    assert injected(inj) == {"corrupt": 1}
    no_tokens = stage_pb2.FrameReply(stream_seq=1, results=[stage_pb2.SlotResult(ok=False)])
    assert inj.reply(no_tokens) == no_tokens and injected(inj) == {"corrupt": 1}


def test_every_fault_counted_once():
    """All kinds at rate 1 on a 3-slot decode frame: each applicable kind happens and is counted once."""
    inj = FaultInjector(FaultConfig(rates={k: 1.0 for k in KINDS}))
    f = make_frame(decode=True)
    assert inj.crash() and inj.forget(f) and inj.delay_s() > 0
    assert inj.outbound(f) == []                       # dropped first: nothing else touches it
    assert injected(inj) == {"crash": 1, "forget_kv": 1, "delay": 1, "drop": 1}
    inj = FaultInjector(FaultConfig(rates={k: 1.0 for k in KINDS if k != "drop"}))
    held = HeldFrames()
    assert inj.outbound(f, held) == [] and len(held.frames) == 2   # corrupted, swapped, crossed, doubled, held
    assert injected(inj) == {"corrupt": 1, "swap_slots": 1, "cross_ids": 1, "duplicate": 1, "reorder": 1}
    out = inj.outbound(make_frame(2, decode=True), held)
    assert [g.stream_seq for g in out] == [2, 2, 1, 1]
    assert injected(inj) == {"corrupt": 2, "swap_slots": 2, "cross_ids": 2, "duplicate": 2, "reorder": 1}


# --- the ledger: which slots a fault hit, and whether the coordinator acted on it ----------------------------
def st(rid: str, epoch: int, position: int) -> stage_pb2.Stamp:
    return stage_pb2.Stamp(request_id=rid, epoch=epoch, position=position)


def frame_of(*stamps: stage_pb2.Stamp, seq: int = 1) -> stage_pb2.Frame:
    return stage_pb2.Frame(stream_seq=seq, slots=[stage_pb2.Slot(stamp=s) for s in stamps])


def signed(frame: stage_pb2.Frame) -> stage_pb2.Frame:
    """As the coordinator sends it: every stamp MACed (twins' MACs differ, for they bind the ids and epochs)."""
    KEY.sign(frame.slots)
    assert len({s.stamp.mac for s in frame.slots}) == len(frame.slots)
    return frame


def test_ledger_caught_by_a_rebuild_or_a_resend_slipped_by_a_later_position():
    led = FaultLedger()
    led.record("corrupt", "outbound", [st("a", 1, 5), st("b", 2, 9), st("c", 1, 3)])
    led.observe("outbound", [st("a", 1, 4), st("b", 1, 30)])      # late copies of older frames: say nothing
    assert len(led.open_slots) == 3
    led.observe("reply", [st("a", 2, 0)])                          # another hook: says nothing
    led.observe("outbound", [st("a", 2, 0), st("b", 2, 9), st("c", 1, 4)])  # rebuilt, resent, went on
    assert led.outcomes == {("corrupt", "caught"): 2, ("corrupt", "slipped"): 1} and not led.open_slots


def test_ledger_a_duplicate_is_logged_not_followed_and_a_stage_refusal_is_no_resend():
    led = FaultLedger()
    led.record("duplicate", "outbound", [st("a", 1, 5)])
    assert led.recorded == 1 and not led.open_slots and "duplicate" not in FOLLOWED
    led.record("cross_ids", "reply", [st("a", 1, 5), st("b", 1, 7)])
    led.observe("reply", [st("a", 1, 5), st("b", 1, 7)], ok=[False, True])   # a's echo is a refusal
    assert led.outcomes == {("cross_ids", "caught"): 1} and [s for _, s in led.open_slots] == [("a", 1, 5)]


def test_the_injector_records_the_slots_each_fault_hit():
    inj = only("forget_kv", seed=4)
    decode = make_frame(decode=True)
    rid = inj.forget(decode)
    (fault, slot), = inj.ledger.open_slots
    assert fault.kind == "forget_kv" and fault.hook == "arrival" and slot == (rid, 1, 2)
    hit = next(sl.stamp for sl in decode.slots if sl.stamp.request_id == rid)
    foreign = stage_pb2.Stamp(request_id=rid, epoch=1, position=5, parent_hash=hit.context_hash + 1)
    inj.forget(frame_of(foreign))                # another chain under this id (crossed upstream): says nothing
    assert inj.ledger.open_slots and not inj.ledger.outcomes
    follow = stage_pb2.Stamp(request_id=rid, epoch=1, position=3, parent_hash=hit.context_hash)
    inj.forget(frame_of(follow))                 # the coordinator went on: the stage's loss was not noticed
    assert inj.ledger.outcomes[("forget_kv", "slipped")] == 1

    inj = only("corrupt", seed=9)
    inj.outbound(make_frame(acts=True))          # activations: every slot of the frame is hit
    assert {s for _, s in inj.ledger.open_slots} == {(f"req-{i}", 1, 0) for i in range(3)}
    inj = only("corrupt", seed=9)
    g = inj.outbound(make_frame(acts=False))[0]  # no activations: the one stamp whose token changed
    (_, slot), = inj.ledger.open_slots
    f = make_frame(acts=False)
    assert [i for i in range(3) if g.slots[i].stamp.token_ids != f.slots[i].stamp.token_ids] == [int(slot[0][-1])]


def test_a_reorder_that_goes_out_in_order_after_all_is_harmless():
    inj = FaultInjector(FaultConfig(rates={"reorder": 1.0}))
    held = HeldFrames()
    inj.outbound(frame_of(st("a", 1, 0), seq=1), held)
    assert inj.flush(held) and not inj.ledger.open_slots        # sent late, in order
    inj.outbound(frame_of(st("a", 1, 1), seq=2), held)
    out = inj.outbound(frame_of(st("b", 1, 0), seq=3), held)    # the reorder happens: a's frame stays followed
    assert [g.stream_seq for g in out] == [3, 2] and [s for _, s in inj.ledger.open_slots] == [("a", 1, 1)]


def test_a_reply_fault_follows_only_results_that_could_become_tokens():
    inj = only("cross_ids", seed=9)
    r = make_reply(2)
    r.results[1].ok = False                       # a rejection: whatever its id says, it is rebuilt
    inj.reply(r)
    assert [s for _, s in inj.ledger.open_slots] == [("req-0", 1, 3)] and inj.ledger.recorded == 1


@pytest.mark.parametrize("kind", ["swap_slots", "cross_ids"])
def test_exchanging_twin_slots_is_logged_harmless(kind):
    """Two identical requests in step (same context, epoch, position): exchanging them changes nothing."""
    twins = signed(frame_of(stamp("a", [7], [1, 2]), stamp("b", [7], [1, 2])))
    inj = only(kind)
    inj.outbound(twins)
    assert injected(inj) == {kind: 1} and inj.ledger.recorded == 1 and not inj.ledger.open_slots
    inj = only(kind)
    inj.outbound(frame_of(stamp("a", [7], [1, 2]), stamp("b", [8], [1, 2])))   # one token apart: followed
    assert len(inj.ledger.open_slots) == 2


def test_swapping_twin_stamps_of_different_epochs_is_harmless_but_crossing_their_ids_is_not():
    """Whole stamps travel with their ids and epochs: rows of the same context are the same bits whatever the
    epochs. Crossing ids alone would give a request the other's epoch: a stage refuses it, so it is followed."""
    a, b = stamp("a", [7], [1, 2]), stamp("b", [7], [1, 2])
    b.epoch = a.epoch + 3
    inj = only("swap_slots")
    inj.outbound(signed(frame_of(a, b)))
    assert injected(inj) == {"swap_slots": 1} and not inj.ledger.open_slots
    inj = only("cross_ids")
    inj.outbound(frame_of(a, b))
    assert len(inj.ledger.open_slots) == 2
