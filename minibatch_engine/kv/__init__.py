"""KV-cache memory: the physical pool, and the managers that hand it out."""
from .pool import KVPool
from .slot import SlotKVCache

__all__ = ["KVPool", "SlotKVCache"]
