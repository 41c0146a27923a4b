"""Per-request KV state and the pool that bounds it."""

from tether.kv.cache import KVCache, KVPool, NoCapacity

__all__ = ["KVCache", "KVPool", "NoCapacity"]
