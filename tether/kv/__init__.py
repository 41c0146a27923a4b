"""Per-request KV state and the pool that bounds it."""

from tether.kv.cache import KVCache, KVPool, NoCapacity
from tether.kv.paged import BlockArena, PagedKV

__all__ = ["BlockArena", "KVCache", "KVPool", "NoCapacity", "PagedKV"]
