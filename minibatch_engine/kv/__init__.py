"""KV-cache memory: the physical pool, and the managers that hand it out."""
from .base import NO_PREFIX, CachedPrefix, KVCacheManager
from .block_manager import BlockManager, chain_hash
from .paged import PagedKVCache
from .pool import KVPool
from .reserved import ReservedKVCache
from .swap import SwapSpace

__all__ = ["KVCacheManager", "CachedPrefix", "NO_PREFIX", "KVPool", "ReservedKVCache", "PagedKVCache",
           "BlockManager", "chain_hash", "SwapSpace"]
