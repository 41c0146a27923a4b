"""Keyed stamps (docs/PROTOCOL.md "Keyed stamps"): the per-pipeline secret that makes a stamp, a token hash
and a payload digest unforgeable by a peer that does not hold it.

The coordinator draws a fresh 32-byte key at every handshake (a new pipeline epoch) and sends it to every
stage in `HandshakeRequest.stamp_key`. With it:

- `stamp_mac(slot)`: keyed BLAKE2b-64 over everything a slot claims (request id, epoch, position, the token
  ids themselves, parent and context hash, sampling digest, hash seed, cached prefix, sample flag). The xxh3
  context chain stays the state check; the MAC says the coordinator issued exactly this claim.
- `token_mac(...)`: the last stage's keyed token hash (chain after the token, request id, epoch, position,
  sampling digest, token id), checked by the coordinator.
- `payload_seed(slots)` / `frame_digest(data, slots)`: the xxh3 payload digest seeded from a keyed BLAKE2b
  of every slot's MAC and row layout (token count, cached prefix), in order: the rows are bound to the exact
  claim that owns them, so no permutation, shift or substitution of stamps against rows goes unnoticed. An
  integrity check that a peer without the key cannot recompute, not a cryptographic MAC of the activation
  bytes (xxh3 is not one; TLS protects the bytes in transit).

Domain separation by BLAKE2b's `person` parameter; each primitive keeps one keyed base object and copies it
per use (a copy is cheaper than keying anew: bench/stamp_mac.py).
"""

from __future__ import annotations

import hmac
import secrets
import struct
from hashlib import blake2b

from tether.protocol.hashing import token_bytes
import xxhash

KEY_BYTES = 32
MAC_BYTES = 8

# epoch, position, number of token ids, parent hash, context hash, sampling digest, hash seed, cached prefix,
# sample flag, length of the request id (then the id's bytes, then the token ids): injective, fixed header.
_STAMP = struct.Struct("<QIIQQQQIBI")
# chain after the token, epoch, position of the token, sampling digest, token id, length of the request id.
_TOKEN = struct.Struct("<QQIQII")
# per slot of the payload seed: the stamp's MAC, its number of token ids, its cached prefix.
_ROWS = struct.Struct("<QII")
_COUNT = struct.Struct("<I")
_U64 = 0xFFFF_FFFF_FFFF_FFFF


class BadStampKey(ValueError):
    """A stamp key of the wrong length."""


class StampKey:
    """One pipeline epoch's stamp key and the keyed primitives over it."""

    __slots__ = ("_stamp", "_token", "_payload", "key")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise BadStampKey(f"a stamp key is {KEY_BYTES} bytes, not {len(key)}")
        self.key = bytes(key)
        self._stamp = blake2b(key=key, digest_size=MAC_BYTES, person=b"tether/v1/stamp")
        self._token = blake2b(key=key, digest_size=MAC_BYTES, person=b"tether/v1/token")
        self._payload = blake2b(key=key, digest_size=MAC_BYTES, person=b"tether/v1/payld")

    @classmethod
    def generate(cls) -> "StampKey":
        return cls(secrets.token_bytes(KEY_BYTES))

    def __repr__(self) -> str:   # never the key itself in a log line
        return "StampKey(…)"

    # --- stamps ------------------------------------------------------------------------------------------
    def _stamp_digest(self, slot) -> bytes:
        st = slot.stamp
        rid = st.request_id.encode("utf-8", "surrogatepass")
        h = self._stamp.copy()
        h.update(_STAMP.pack(st.epoch & _U64, st.position, len(st.token_ids), st.parent_hash, st.context_hash,
                             st.sampling_digest, slot.hash_seed, slot.cached_prefix, 1 if slot.sample else 0,
                             len(rid)))
        h.update(rid)
        h.update(token_bytes(st.token_ids))
        return h.digest()

    def stamp_mac(self, slot) -> int:
        """The MAC of a stage_pb2.Slot's claim (its stamp, hash seed, cached prefix and sample flag)."""
        return int.from_bytes(self._stamp_digest(slot), "little")

    def sign(self, slots) -> None:
        """Set every slot's `stamp.mac` (the coordinator, once per frame)."""
        for s in slots:
            s.stamp.mac = int.from_bytes(self._stamp_digest(s), "little")

    def verify(self, slot) -> bool:
        """Whether the slot's `stamp.mac` is this key's MAC of what it claims (constant-time compare)."""
        return hmac.compare_digest(self._stamp_digest(slot), slot.stamp.mac.to_bytes(MAC_BYTES, "little"))

    # --- tokens ------------------------------------------------------------------------------------------
    def token_mac(self, context_after_token: int, request_id: str, epoch: int, position: int,
                  sampling_digest: int, token_id: int) -> int:
        """The keyed token hash the last stage returns with a sampled token (`position`: the token's own)."""
        rid = request_id.encode("utf-8", "surrogatepass")
        h = self._token.copy()
        h.update(_TOKEN.pack(context_after_token, epoch & _U64, position, sampling_digest, token_id, len(rid)))
        h.update(rid)
        return int.from_bytes(h.digest(), "little")

    # --- payload -----------------------------------------------------------------------------------------
    def payload_seed(self, slots) -> int:
        """xxh3 seed of a frame's payload digest: keyed BLAKE2b-64 over the slot count, then per slot (in order)
        its `stamp.mac`, number of token ids and cached prefix.

        The MAC binds everything the slot claims (id, epoch, position, tokens, hashes, sampling digest, hash
        seed, cached prefix, sample flag); every path signs before it digests, so it is read, not recomputed.
        The token count and cached prefix fix which rows are the slot's even when its claim is forged: a stage
        that refuses one slot as STAMP_FORGED still slices the others' rows where the signer put them."""
        h = self._payload.copy()
        h.update(_COUNT.pack(len(slots)))
        for s in slots:
            h.update(_ROWS.pack(s.stamp.mac, len(s.stamp.token_ids), s.cached_prefix))
        return int.from_bytes(h.digest(), "little")

    def frame_digest(self, data: bytes, slots) -> int:
        """The payload digest of a frame's activation bytes over its (signed) slots, stage_pb2.Slot: xxh3-64 of
        the bytes, seeded by `payload_seed(slots)`."""
        return xxhash.xxh3_64_intdigest(data, seed=self.payload_seed(slots))

    def seal(self, frame) -> None:
        """Sign every slot of a stage_pb2.Frame and set its payload digest (tests and tools)."""
        self.sign(frame.slots)
        frame.payload_digest = self.frame_digest(frame.activations.data, frame.slots)
