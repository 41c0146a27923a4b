"""Keyed stamps (tether.protocol.stamp_key): the stamp MAC binds every field a slot claims, the token hash and
the payload digest's seed are keyed, and another key (or none) gives other values."""

from __future__ import annotations

import struct
from hashlib import blake2b

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.protocol.hashing import context_hash, hash_seed, token_bytes
from tether.protocol.stamp_key import KEY_BYTES, BadStampKey, StampKey
from tether.v1 import stage_pb2

SEED = hash_seed("fingerprint-abc", "tenant-a")
KEY = StampKey(bytes(range(32)))
OTHER = StampKey(bytes(range(1, 33)))
FAST = settings(max_examples=200, deadline=None, database=None)


def slot(**over) -> stage_pb2.Slot:
    ids = over.pop("token_ids", [5, 6, 7])
    st_ = stage_pb2.Stamp(request_id="0123abcd", epoch=3, position=2, token_ids=ids,
                          parent_hash=context_hash(SEED, [1, 2]), context_hash=context_hash(SEED, [1, 2, *ids]),
                          sampling_digest=0xFEED)
    s = stage_pb2.Slot(stamp=st_, hash_seed=SEED, sample=True, cached_prefix=0)
    for k, v in over.items():
        if hasattr(st_, k) and k not in ("sample",):
            setattr(s.stamp, k, v)
        else:
            setattr(s, k, v)
    return s


# Each bound field, changed alone.
CHANGES = {
    "request_id": "0123abce", "epoch": 4, "position": 3, "token_ids": [5, 6, 8], "parent_hash": 1,
    "context_hash": 2, "sampling_digest": 0xFEEE, "hash_seed": SEED ^ 1, "cached_prefix": 64, "sample": False,
}


def test_the_mac_is_constant_for_the_same_claim():
    assert KEY.stamp_mac(slot()) == KEY.stamp_mac(slot()) == StampKey(bytes(range(32))).stamp_mac(slot())


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_the_mac_changes_with_every_bound_field(field):
    assert KEY.stamp_mac(slot(**{field: CHANGES[field]})) != KEY.stamp_mac(slot())


def test_token_ids_are_bound_themselves_not_only_their_count():
    # same count, same hashes (left as they were): only the ids differ
    a, b = slot(), slot()
    b.stamp.token_ids[1] = 9
    assert KEY.stamp_mac(a) != KEY.stamp_mac(b)


def test_the_traceparent_is_not_bound():
    a, b = slot(), slot()
    b.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert KEY.stamp_mac(a) == KEY.stamp_mac(b)


def test_another_key_gives_another_mac_and_verify_needs_the_key():
    s = slot()
    KEY.sign([s])
    assert s.stamp.mac == KEY.stamp_mac(s) != OTHER.stamp_mac(s)
    assert KEY.verify(s) and not OTHER.verify(s)
    s.stamp.mac ^= 1
    assert not KEY.verify(s)


def test_an_unkeyed_recomputation_is_not_the_mac():
    """What an attacker without the key can compute (unkeyed BLAKE2b or xxh3 of the same encoding) is not it."""
    s = slot()
    KEY.sign([s])
    unkeyed = blake2b(digest_size=8, person=b"tether/v1/stamp")
    unkeyed.update(s.stamp.SerializeToString())
    assert s.stamp.mac not in (int.from_bytes(unkeyed.digest(), "little"),
                               xxhash.xxh3_64_intdigest(s.stamp.SerializeToString()))


def test_the_encoding_is_the_documented_one():
    """docs/PROTOCOL.md "Keyed stamps", spelled out so another implementation can reproduce it."""
    s = slot(cached_prefix=64)
    st_ = s.stamp
    rid = st_.request_id.encode()
    h = blake2b(key=KEY.key, digest_size=8, person=b"tether/v1/stamp")
    h.update(struct.pack("<QIIQQQQIBI", st_.epoch, st_.position, len(st_.token_ids), st_.parent_hash,
                         st_.context_hash, st_.sampling_digest, s.hash_seed, s.cached_prefix, 1, len(rid)))
    h.update(rid + token_bytes(st_.token_ids))
    assert KEY.stamp_mac(s) == int.from_bytes(h.digest(), "little")
    t = blake2b(key=KEY.key, digest_size=8, person=b"tether/v1/token")
    t.update(struct.pack("<QQIQII", 11, 3, 5, 0xFEED, 42, len(rid)) + rid)
    assert KEY.token_mac(11, st_.request_id, 3, 5, 0xFEED, 42) == int.from_bytes(t.digest(), "little")


@pytest.mark.parametrize("n", [0, 31, 33, 64])
def test_a_key_of_the_wrong_length_is_refused(n):
    with pytest.raises(BadStampKey):
        StampKey(bytes(n))
    assert len(StampKey.generate().key) == KEY_BYTES


def test_generated_keys_differ_and_the_repr_hides_the_key():
    a, b = StampKey.generate(), StampKey.generate()
    assert a.key != b.key and a.stamp_mac(slot()) != b.stamp_mac(slot())
    assert a.key.hex() not in repr(a)


def test_the_token_mac_binds_each_input():
    base = (0xABC, "r1", 2, 17, 0xFEED, 42)
    ref = KEY.token_mac(*base)
    assert ref == KEY.token_mac(*base)
    for i, v in enumerate([0xABD, "r2", 3, 18, 0xFEEE, 43]):
        args = list(base)
        args[i] = v
        assert KEY.token_mac(*args) != ref, f"input {i} not bound"
    assert OTHER.token_mac(*base) != ref


def signed(slots) -> list[stage_pb2.Slot]:
    KEY.sign(slots)
    return slots


def test_payload_digest_binds_bytes_each_slots_mac_and_rows_in_order_and_the_key():
    data = bytes(range(256)) * 4
    slots = signed([slot(request_id=f"r{i}", token_ids=[i + 1]) for i in range(3)])
    d = KEY.frame_digest(data, slots)
    assert d == KEY.frame_digest(bytes(data), list(slots))
    flipped = bytearray(data)
    flipped[500] ^= 1
    assert KEY.frame_digest(bytes(flipped), slots) != d                   # any byte
    assert KEY.frame_digest(data[:-1], slots) != d                       # truncation
    assert KEY.frame_digest(data, [slots[1], slots[0], slots[2]]) != d   # slot order matters
    assert KEY.frame_digest(data, slots[:2]) != d                        # a slot dropped
    assert KEY.frame_digest(data, [*slots, slots[2]]) != d               # a slot duplicated
    assert OTHER.frame_digest(data, slots) != d                          # another key
    for field in ("mac", "token_count", "cached_prefix"):                # each part of a slot's binding
        bent = [stage_pb2.Slot() for _ in slots]
        for x, y in zip(bent, slots):
            x.CopyFrom(y)
        if field == "mac":
            bent[1].stamp.mac ^= 1
        elif field == "token_count":
            bent[1].stamp.token_ids.append(9)                            # its MAC (as sent) left as it was
        else:
            bent[1].cached_prefix = 64
        assert KEY.frame_digest(data, bent) != d, field
    # the unkeyed seed of protocol v1 (xxh3 of the context hashes) no longer gives it
    unkeyed = xxhash.xxh3_64_intdigest(struct.pack("<3Q", *(s.stamp.context_hash for s in slots)))
    assert xxhash.xxh3_64_intdigest(data, seed=unkeyed) != d


def test_twins_that_differ_only_in_position_bind_differently():
    """Issue 23: twins with the same context end (equal context hashes) at different start positions: v1 bound
    only the context hash, so their stamps could be swapped against the rows unnoticed."""
    ids = list(range(1, 9))
    decode = slot(request_id="a", position=7, token_ids=ids[7:], parent_hash=context_hash(SEED, ids[:7]),
                  context_hash=context_hash(SEED, ids))
    replay = slot(request_id="b", epoch=4, position=0, token_ids=ids, parent_hash=context_hash(SEED, []),
                  context_hash=context_hash(SEED, ids))
    other = slot(request_id="c")
    sent = signed([replay, other, decode])
    assert KEY.frame_digest(b"rows", sent) != KEY.frame_digest(b"rows", [decode, other, replay])


def test_payload_seed_is_keyed_blake2b_of_each_slots_mac_and_rows():
    slots = signed([slot(request_id=f"r{i}", token_ids=list(range(1, 66)), cached_prefix=64 * (i % 2))
                    for i in range(3)])
    h = blake2b(key=KEY.key, digest_size=8, person=b"tether/v1/payld")
    h.update(struct.pack("<I", 3))
    for s in slots:
        h.update(struct.pack("<QII", s.stamp.mac, len(s.stamp.token_ids), s.cached_prefix))
    seed = int.from_bytes(h.digest(), "little")
    assert KEY.payload_seed(slots) == seed
    assert KEY.frame_digest(b"act", slots) == xxhash.xxh3_64_intdigest(b"act", seed=seed)


def test_seal_signs_every_slot_and_sets_the_digest():
    f = stage_pb2.Frame(stream_seq=1, pipeline_epoch=9, slots=[slot(request_id="a"), slot(request_id="b")])
    KEY.seal(f)
    assert all(KEY.verify(s) for s in f.slots)
    assert f.payload_digest == KEY.frame_digest(b"", f.slots)


@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=40), rid=st.text(max_size=40),
       epoch=st.integers(0, 2**64 - 1), pos=st.integers(0, 2**32 - 1), flip=st.integers(0, 63))
@FAST
def test_any_claim_verifies_under_its_key_only_and_one_bit_of_mac_breaks_it(ids, rid, epoch, pos, flip):
    s = slot(token_ids=ids, request_id=rid, epoch=epoch, position=pos)
    KEY.sign([s])
    assert KEY.verify(s) and not OTHER.verify(s)
    s.stamp.mac ^= 1 << flip
    assert not KEY.verify(s)
