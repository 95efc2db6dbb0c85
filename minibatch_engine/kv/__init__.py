"""KV-cache memory: the physical pool, and the managers that hand it out."""
from .block_manager import BlockManager, chain_hash
from .paged import PagedKVCache
from .pool import KVPool
from .slot import SlotKVCache
from .swap import SwapSpace

__all__ = ["KVPool", "SlotKVCache", "PagedKVCache", "BlockManager", "chain_hash", "SwapSpace"]
