"""Where NoCapacity used to live, kept so that `from tether.kv.cache import NoCapacity` still works; it is
defined with the block pool that raises it (tether/kv/blocks.py). The plain kernels' contiguous KV that this
module held is now tether/model/plain.py's KVCache, a benchmark baseline only."""

from tether.kv.blocks import NoCapacity

__all__ = ["NoCapacity"]
