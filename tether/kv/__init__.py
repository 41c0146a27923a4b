"""Per-request KV state: the paged arena, each request's block table, and the block pool that bounds it."""

from tether.kv.blocks import NoCapacity
from tether.kv.paged import BlockArena, PagedKV

__all__ = ["BlockArena", "NoCapacity", "PagedKV"]
