"""What every KV-cache manager shares: a physical pool and its accounting.

A manager (slot or paged) decides which part of the pool each request owns;
the scheduler talks to it through ``allocate``, ``free``, ``block_table``,
``match_prefix``, ``mark_computed``, ``fork`` and ``holds``, and the trace reads
``reserved_bytes`` and ``used_bytes``.
"""
from __future__ import annotations

from .pool import KVPool


class KVCacheManager:
    pool: KVPool
    block_size: int

    def layer(self, i: int):
        """(k_slots, v_slots) of layer ``i`` for the model's attention."""
        return self.pool.layer(i)

    @property
    def bytes_per_token(self) -> int:
        return self.pool.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        """The whole pool: what the cache took from device memory."""
        return self.pool.allocated_bytes
