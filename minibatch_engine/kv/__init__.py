"""KV-cache memory: the managers that hand it out (the scheduler's bookkeeping),
and the physical pools (the runner's tensors)."""
from .base import NO_PREFIX, CachedPrefix, KVCacheManager
from .block_manager import BlockManager, chain_hash
from .paged import PagedKVCache
from .pool import KVPool
from .reserved import ReservedKVCache
from .swap import HostKVPool, SwapSpace

__all__ = ["KVCacheManager", "CachedPrefix", "NO_PREFIX", "KVPool", "ReservedKVCache", "PagedKVCache",
           "BlockManager", "chain_hash", "SwapSpace", "HostKVPool"]
