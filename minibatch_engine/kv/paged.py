"""Paged KV cache (PagedAttention): blocks handed out as sequences grow.

The physical pool (the runner's :class:`~.pool.KVPool`) is carved into
``block_size``-token blocks; the :class:`BlockManager` keeps block tables,
reference counts and the prefix cache; this class puts the interface around it
and queues the bytes that must move for the runner: a shared block's contents
copied before a write (copy-on-write), and a preempted request's blocks copied
to host memory and back (swap). Attention reads K/V through the block tables,
so a sequence's blocks can lie anywhere in the pool.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..core.outputs import BlockCopy
from .block_manager import BlockManager
from .base import NO_PREFIX, CachedPrefix, KVCacheManager


class PagedKVCache(KVCacheManager):
    """``num_blocks`` blocks of ``block_size`` tokens, handed out on demand
    (``dtype`` sizes the bytes the trace reports; no memory is taken here)."""

    def __init__(self, model_config, num_blocks: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, enable_prefix_caching: bool = True,
                 watermark: float = 0.01, hash_fn=None, kv_cache_dtype: str = "auto"):
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        super().__init__(model_config, num_blocks, block_size, dtype, kv_cache_dtype)
        kwargs = {} if hash_fn is None else {"hash_fn": hash_fn}
        self.manager = BlockManager(num_blocks, block_size, enable_prefix_caching, **kwargs)
        # Admission keeps a few blocks free so running requests can still grow.
        self.watermark_blocks = int(watermark * num_blocks)

    # --- the KVCacheManager interface ---------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.manager.num_used_blocks

    def max_tokens_per_request(self) -> int:
        return self.num_blocks * self.block_size

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: list[int] | None = None) -> CachedPrefix:
        blocks, num_tokens = self.manager.find_cached_prefix(token_ids, block_hashes)
        return CachedPrefix(tuple(blocks), num_tokens)

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                 prefix: CachedPrefix = NO_PREFIX, headroom: int = 0) -> bool:
        """Make room for ``num_tokens`` tokens; tokens from ``num_computed_tokens`` on
        will be written, so any shared block there is first copied (copy-on-write:
        the copy is queued for the runner). A new request commits its cached
        ``prefix`` blocks first."""
        m = self.manager
        table = m.block_tables.get(request_id)
        if table and not prefix.block_ids and num_tokens <= len(table) * self.block_size \
                and num_computed_tokens // self.block_size == len(table) - 1 \
                and m.blocks[table[-1]].ref_count == 1:
            return True          # writes only into its own last block, which has room (most decodes)
        copies = m.num_blocks_to_copy(request_id, num_computed_tokens)
        if copies:
            if m.num_new_blocks(request_id, num_tokens) + copies > m.num_free_blocks - headroom:
                return False
            self._copies += [BlockCopy("copy", src, dst) for src, dst in m.copy_on_write(request_id,
                                                                                         num_computed_tokens)]
        return m.allocate(request_id, num_tokens, prefix.block_ids, headroom)

    def mark_computed(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                      prev_computed: int = 0) -> None:
        self.manager.mark_computed(request_id, token_ids, num_computed, prev_computed)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        self.manager.truncate(request_id, num_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        self.manager.fork(parent_id, child_id)

    def free(self, request_id: str) -> None:
        self.manager.free_request(request_id)

    def swap_out(self, request_id: str, swap) -> int:
        """Move a request's blocks to host blocks of the swap space and free them here."""
        table = list(self.manager.table(request_id))
        host = swap.swap_out(request_id, len(table))
        self._copies += [BlockCopy("swap_out", src, dst) for src, dst in zip(table, host)]
        self.manager.free_request(request_id)
        return len(table) * self.bytes_per_block

    def can_swap_in(self, swap, request_id: str, headroom: int = 0) -> bool:
        return len(swap.tables[request_id]) + headroom <= self.manager.num_free_blocks

    def swap_in(self, request_id: str, swap, token_ids, num_computed: int) -> int:
        """Take fresh blocks and bring the request's swapped K/V back into them."""
        num_blocks = len(swap.tables[request_id])
        if not self.manager.allocate(request_id, num_blocks * self.block_size):
            raise RuntimeError(f"no room to swap {request_id!r} back in")
        host = swap.swap_in(request_id)
        self._copies += [BlockCopy("swap_in", src, dst) for src, dst in zip(host, self.manager.table(request_id))]
        self.manager.mark_computed(request_id, token_ids, num_computed)
        return num_blocks * self.bytes_per_block

    def record_kv_events(self) -> None:
        self.manager.record_events()

    def take_kv_events(self) -> list:
        return self.manager.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while a request holds blocks."""
        return self.manager.reset_prefix_cache()

    def block_table(self, request_id: str) -> list[int]:
        return self.manager.table(request_id)

    def first_block(self, request_id: str) -> int:
        table = self.manager.block_tables.get(request_id)    # (the trace asks this per request per step)
        return table[0] if table else -1

    # --- memory accounting -------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        """Bytes of the blocks some request holds now."""
        return self.manager.num_used_blocks * self.bytes_per_block

    @property
    def used_bytes(self) -> int:
        """Bytes of those blocks that hold a token (a shared block counts once)."""
        return self.manager.used_tokens() * self.bytes_per_token
