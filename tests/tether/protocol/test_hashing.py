"""The context hash chain and its seed (the keyed digests: test_stamp_key.py)."""

from __future__ import annotations

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.protocol.hashing import (
    ContextHasher,
    context_hash,
    hash_seed,
    prompt_digest,
    token_bytes,
)

SEED = hash_seed("fingerprint-abc", "tenant-a")
token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=80)
FAST = settings(max_examples=200, deadline=None, database=None)


def chain(seed: int, chunks) -> ContextHasher:
    h = ContextHasher(seed)
    for c in chunks:
        h.extend(c)
    return h


@given(ids=token_lists, data=st.data())
@FAST
def test_chain_is_independent_of_chunking(ids, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    bounds = [0, *cuts, len(ids)]
    chunks = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
    h = chain(SEED, chunks)
    assert h.value == context_hash(SEED, ids) == chain(SEED, [ids]).value
    assert h.length == len(ids)


@given(ids=token_lists, data=st.data())
@FAST
def test_chain_equals_xxh3_over_little_endian_uint32(ids, data):
    seed = data.draw(st.integers(0, 2**64 - 1))
    raw = b"".join(t.to_bytes(4, "little") for t in ids)
    assert token_bytes(ids) == raw
    assert context_hash(seed, ids) == xxhash.xxh3_64_intdigest(raw, seed=seed)
    assert ContextHasher(seed).extend(ids) == context_hash(seed, ids)


@given(ids=token_lists, more=token_lists)
@FAST
def test_peek_does_not_commit(ids, more):
    h = chain(SEED, [ids])
    before, length = h.value, h.length
    peeked = h.peek(more)
    assert (h.value, h.length) == (before, length)
    assert peeked == context_hash(SEED, ids + more)
    assert h.peek(more) == peeked                      # repeatable
    assert h.extend(more) == peeked and h.value == peeked
    assert h.length == length + len(more)


def test_copy_is_independent():
    h = chain(SEED, [[1, 2, 3]])
    c = h.copy()
    c.extend([4])
    assert h.value == context_hash(SEED, [1, 2, 3]) and h.length == 3
    assert c.value == context_hash(SEED, [1, 2, 3, 4]) and c.length == 4 and c.seed == h.seed


def test_empty_chain_and_empty_extension():
    h = ContextHasher(SEED)
    assert h.value == context_hash(SEED, []) and h.length == 0
    assert h.extend([]) == h.value and h.length == 0


def test_seed_binds_model_and_tenant():
    ids = [1, 2, 3, 257]
    seeds = {hash_seed("fp1", ""), hash_seed("fp1", "a"), hash_seed("fp1", "b"), hash_seed("fp2", ""),
             hash_seed("fp2", "a")}
    assert len(seeds) == 5
    assert len({context_hash(s, ids) for s in seeds}) == 5
    assert hash_seed("fp1", "a") == hash_seed("fp1", "a")        # deterministic across calls
    # the separator keeps (fingerprint, namespace) pairs apart
    assert hash_seed("ab", "c") != hash_seed("a", "bc")
    assert ContextHasher(hash_seed("fp1", "a")).extend(ids) != ContextHasher(hash_seed("fp1", "b")).extend(ids)


def test_chain_distinguishes_order_boundaries_and_large_ids():
    values = {context_hash(SEED, ids) for ids in ([1, 2], [2, 1], [1, 2, 0], [0, 1, 2], [258], [2, 1, 0],
                                                  [2**32 - 1], [65536 + 1])}
    assert len(values) == 8
    # token ids are whole uint32s, not bytes: [1, 0] and [256] have different encodings
    assert token_bytes([256]) != token_bytes([0, 1])


def test_prompt_digest_is_seed_zero_xxh3():
    text = "你好 tether".encode()
    assert prompt_digest(text) == xxhash.xxh3_64_intdigest(text, seed=0)
    assert prompt_digest(text) != prompt_digest(text + b" ")


def test_messages_digest_is_the_length_prefixed_serialization():
    """docs/PROTOCOL.md "End-to-end receipt", spelled out so another client can reproduce it."""
    from tether.protocol.hashing import messages_digest
    msgs = [("system", "Be brief.".encode()), ("user", "你好".encode()), ("assistant", b"")]
    wire = b"tether/v1/messages\0" + b"".join(
        len(r.encode()).to_bytes(4, "little") + r.encode() + len(c).to_bytes(4, "little") + c for r, c in msgs)
    assert messages_digest(msgs) == xxhash.xxh3_64_intdigest(wire)
    # Boundaries count: moving bytes between role and content, or between messages, changes the digest.
    assert messages_digest([("user", b"ab")]) != messages_digest([("usera", b"b")])
    assert messages_digest([("user", b"a"), ("user", b"b")]) != messages_digest([("user", b"ab")])
    assert messages_digest([("user", b"hi")]) != prompt_digest(b"hi")
