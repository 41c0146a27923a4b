"""Keyed stamps against live stage processes (issue 14 part 4): a frame whose stamps were recomputed
without the pipeline's stamp key (the right xxh3 chain, the MAC unkeyed, zero or under another key) is
rejected before it touches any state, with STAMP_FORGED when the payload digest is right (only a key holder
could make it: it binds every slot's MAC as sent) and DIGEST_MISMATCH otherwise; what the stage holds (SyncState) does not change,
and Stats counts the rejections. Legitimate slots in the same frame go through."""

from __future__ import annotations

from hashlib import blake2b

import pytest

from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

RejectReason = stage_pb2.RejectReason
OTHER = StampKey(bytes(range(100, 132)))   # a key the stages were never given


@pytest.fixture(scope="module")
def full(start_stage):
    """All layers: embeds token ids, samples."""
    s = start_stage()
    s.handshake()
    return s


@pytest.fixture(scope="module")
def tail(start_stage):
    """Layers [2, 4) of tiny: takes activations, holds the head."""
    s = start_stage("--layers", "1/2")
    s.handshake()
    return s


def reasons(reply) -> list[str]:
    return [RejectReason.Name(r.reason) if not r.ok else "ok" for r in reply.results]


def unkeyed_mac(slot: stage_pb2.Slot) -> int:
    """What a forger without the key can compute over the same claim: BLAKE2b with no key."""
    h = blake2b(digest_size=8, person=b"tether/v1/stamp")
    h.update(slot.stamp.SerializeToString(deterministic=True))
    return int.from_bytes(h.digest(), "little")


FORGERIES = {
    "unkeyed": unkeyed_mac,
    "other_key": OTHER.stamp_mac,
    "no_mac": lambda slot: 0,
}


def _held_request(stage, stream, kit, rid, acts):
    req = kit.Req(rid, list(b"keyed stamps"))
    rows = len(req.ids)
    reply = stream.ask(stream.frame([req.slot()], kit.activations(rows, seed=rows) if acts else None))
    assert reasons(reply) == ["ok"], reply
    req.accept(reply.results[0].token_id)
    return req


def _forged_frame(stream, kit, slots, forged: int, forge, acts, right_digest: bool) -> stage_pb2.Frame:
    """A frame whose slot `forged` carries a recomputed stamp: the right chain, the MAC from `forge`. With
    `right_digest` the payload digest is the pipeline key's over the frame as it is (the digest binds each
    slot's MAC as sent, so only a key holder could make it: the MAC check is tested on its own); otherwise the
    forger computes it too, under a key of its own."""
    frame = stream.frame(slots, acts)              # signed and digested with the pipeline's key
    frame.slots[forged].stamp.mac = forge(frame.slots[forged])
    frame.payload_digest = (kit.KEY if right_digest else OTHER).frame_digest(frame.activations.data, frame.slots)
    return frame


@pytest.mark.parametrize("how", sorted(FORGERIES))
@pytest.mark.parametrize("which", ["full", "tail"])
def test_a_recomputed_stamp_is_rejected_and_changes_nothing(request, kit, how, which):
    stage = request.getfixturevalue(which)
    acts = which == "tail"
    stream = stage.stream()
    victim = _held_request(stage, stream, kit, f"victim-{how}", acts)
    honest = _held_request(stage, stream, kit, f"honest-{how}", acts)
    before = stage.held(victim.rid), stage.stats().rejections["STAMP_FORGED"]
    # the forger appends a token of its choosing to the victim's context, chain recomputed correctly
    victim.ids[-1] = (victim.ids[-1] + 1) % kit.CFG.vocab_size
    slots = [victim.slot(), honest.slot()]
    frame = _forged_frame(stream, kit, slots, 0, FORGERIES[how], kit.activations(2) if acts else None, True)
    reply = stream.ask(frame)
    assert reasons(reply) == ["STAMP_FORGED", "ok"]
    assert reply.results[0].stamp.request_id == victim.rid and reply.results[0].stage_index == (1 if acts else 0)
    assert not reply.results[0].has_token and reply.results[1].has_token
    assert stage.held(victim.rid) == before[0]          # SyncState: same epoch, length and hash
    assert stage.stats().rejections["STAMP_FORGED"] == before[1] + 1
    stream.end()


@pytest.mark.parametrize("which", ["full", "tail"])
def test_a_wholly_forged_frame_fails_the_keyed_payload_digest(request, kit, which):
    """A forger who recomputes everything (stamps and the digest) without the key: the frame-level check
    already refuses every slot, before any stamp is read."""
    stage = request.getfixturevalue(which)
    acts = which == "tail"
    stream = stage.stream()
    victim = _held_request(stage, stream, kit, "victim-all", acts)
    before = stage.held(victim.rid)
    victim.ids[-1] = (victim.ids[-1] + 1) % kit.CFG.vocab_size
    frame = _forged_frame(stream, kit, [victim.slot()], 0, OTHER.stamp_mac,
                          kit.activations(1) if acts else None, False)
    assert reasons(stream.ask(frame)) == ["DIGEST_MISMATCH"]
    assert stage.held(victim.rid) == before
    stream.end()


def test_an_honest_stamp_still_goes_through_after_a_forgery(full, kit):
    """A rejection leaves the request exactly where it was: the coordinator's next honest stamp continues it."""
    stream = full.stream()
    req = _held_request(full, stream, kit, "continues", False)
    good = req.slot()
    frame = stream.frame([good])
    forged = stage_pb2.Frame()
    forged.CopyFrom(frame)
    forged.slots[0].stamp.mac = unkeyed_mac(forged.slots[0])
    assert reasons(stream.ask(forged)) == ["DIGEST_MISMATCH"]   # the digest binds the MAC as it was sent
    forged.stream_seq = frame.stream_seq + 1
    stream.seq += 1
    forged.payload_digest = kit.KEY.frame_digest(b"", forged.slots)   # made by a key holder: the MAC check alone
    assert reasons(stream.ask(forged)) == ["STAMP_FORGED"]
    assert reasons(stream.ask(stream.frame([req.slot()]))) == ["ok"]
    stream.end()


def test_only_the_unsafe_experiment_skips_the_mac(kit):
    """--unsafe-disable-stamp-checks (experiments only) skips the MAC with the other checks; a worker with the
    checks on refuses the same frame, and one that holds no key refuses every slot."""
    from services.stage_worker.worker import StageWorker
    from tether.model.loader import load_slice, resolve_model

    model = load_slice(resolve_model("tiny"), 0, kit.CFG.num_hidden_layers)
    req = kit.Req("unsafe", list(b"abc"))
    frame = kit.make_frame([req.slot()], epoch=1)
    frame.slots[0].stamp.mac = unkeyed_mac(frame.slots[0])
    frame.payload_digest = kit.KEY.frame_digest(b"", frame.slots)
    unsafe = StageWorker(model, 0, 4096, stamp_checks=False, stamp_key=kit.KEY)
    checked = StageWorker(model, 0, 4096, stamp_key=kit.KEY)
    keyless = StageWorker(model, 0, 4096)
    assert [r.ok for r in unsafe.process(frame).results] == [True]
    assert reasons(stage_pb2.FrameReply(results=checked.process(frame).results)) == ["STAMP_FORGED"]
    honest = kit.make_frame([req.slot()], epoch=1)
    assert reasons(stage_pb2.FrameReply(results=keyless.process(honest).results)) == ["STAMP_FORGED"]
    assert checked.state.requests == {} and keyless.state.requests == {}
