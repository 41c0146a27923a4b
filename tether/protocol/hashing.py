"""The context hash chain (docs/PROTOCOL.md "Context hash chain").

xxh3-64 over the little-endian uint32 token ids of the whole context, seeded from the model fingerprint and
the request's cache namespace. Streaming makes it independent of chunking, so each party extends a running
hasher by the new tokens only.
"""

from __future__ import annotations

from array import array
import struct
import sys

import xxhash

_LITTLE = sys.byteorder == "little"


def token_bytes(token_ids) -> bytes:
    a = array("I", token_ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def hash_seed(model_fingerprint: str, namespace: str = "") -> int:
    """The salt of a request's chain: differs per model and per tenant namespace."""
    return xxhash.xxh3_64_intdigest(f"tether/v1|{model_fingerprint}|{namespace}".encode())


def context_hash(seed: int, token_ids) -> int:
    return xxhash.xxh3_64_intdigest(token_bytes(token_ids), seed=seed)


class ContextHasher:
    """A running context hash; `peek` gives the hash after some tokens without committing them."""

    __slots__ = ("seed", "_h", "length")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._h = xxhash.xxh3_64(seed=seed)
        self.length = 0

    @property
    def value(self) -> int:
        return self._h.intdigest()

    def peek(self, token_ids) -> int:
        h = self._h.copy()
        h.update(token_bytes(token_ids))
        return h.intdigest()

    def extend(self, token_ids) -> int:
        self._h.update(token_bytes(token_ids))
        self.length += len(token_ids)
        return self._h.intdigest()

    def extend_each(self, token_ids) -> list[int]:
        """Extend by `token_ids` one at a time; the chain's value after each (the prefix cache's keys inside a
        block)."""
        out = []
        for t in token_ids:
            self._h.update(token_bytes((t,)))
            out.append(self._h.intdigest())
        self.length += len(out)
        return out

    def copy(self) -> "ContextHasher":
        c = ContextHasher.__new__(ContextHasher)
        c.seed, c._h, c.length = self.seed, self._h.copy(), self.length
        return c


def sampling_digest(sampling) -> int:
    """Digest of a SamplingParams message (deterministic serialization): what the stamp and token hash bind."""
    return xxhash.xxh3_64_intdigest(sampling.SerializeToString(deterministic=True))


def prompt_digest(prompt: bytes) -> int:
    """Receipt digest of the prompt bytes as admission received them."""
    return xxhash.xxh3_64_intdigest(prompt)


_MESSAGES_DOMAIN = b"tether/v1/messages\0"


def messages_digest(messages) -> int:
    """Receipt digest of a conversation as admission received it: (role, content bytes) pairs, in order.

    xxh3-64 of a domain prefix, then per message the role's and the content's UTF-8 bytes, each after its
    length as a little-endian uint32: no two conversations serialize alike, and the prefix keeps a
    conversation's digest apart from that of a raw prompt holding the same text.
    """
    h = xxhash.xxh3_64()
    h.update(_MESSAGES_DOMAIN)
    for role, content in messages:
        role_bytes = role.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<I", len(role_bytes)))
        h.update(role_bytes)
        h.update(struct.pack("<I", len(content)))
        h.update(content)
    return h.intdigest()
