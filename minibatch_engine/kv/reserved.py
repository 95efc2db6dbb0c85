"""Reserved KV cache: every admitted request reserves ``max_model_len`` tokens up front.

This is how padded ``generate``, FasterTransformer-style static batching and
Orca reserve memory: one contiguous row of the cache per sequence, sized for
the longest sequence the model may ever produce, whatever this request will
need. In the pool's terms each row is one block of ``max_model_len`` tokens, so
a request's block table is a single entry: its row. A row is private (no
prefix sharing, no forks) and never runs out mid-sequence, so a scheduler on
this cache never has to preempt.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .base import NO_PREFIX, CachedPrefix, KVCacheManager


class ReservedKVCache(KVCacheManager):
    """``num_rows`` rows, each a reservation of ``max_model_len`` tokens
    (``dtype`` sizes the bytes; the runner's pool holds the rows themselves)."""

    watermark_blocks = 0

    def __init__(self, model_config, num_rows: int, max_model_len: int, dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: str = "auto"):
        if not isinstance(num_rows, int) or num_rows <= 0:
            raise ValueError(f"num_rows must be a positive integer, got {num_rows!r}")
        if not isinstance(max_model_len, int) or max_model_len <= 0:
            raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
        self.max_model_len = max_model_len
        super().__init__(model_config, num_rows, max_model_len, dtype, kv_cache_dtype)
        self.free_rows: list[int] = list(range(num_rows))
        self.row_of: dict[str, int] = {}         # request_id -> row
        self.num_tokens: dict[str, int] = {}     # request_id -> tokens with K/V

    @property
    def num_rows(self) -> int:
        return self.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return len(self.row_of)

    def max_tokens_per_request(self) -> int:
        return self.max_model_len

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: list[int] | None = None) -> CachedPrefix:
        return NO_PREFIX          # rows are private: nothing is shared

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                 prefix: CachedPrefix = NO_PREFIX, headroom: int = 0) -> bool:
        """Reserve a whole row the first time (if ``headroom`` rows stay free);
        afterwards any length up to ``max_model_len`` fits. Rows are private, so
        nothing is ever copied before a write."""
        if prefix:
            raise ValueError("a reserved cache has no prefix cache to commit from")
        if num_tokens > self.max_model_len:
            return False
        if request_id not in self.row_of:
            if len(self.free_rows) <= headroom:
                return False
            self.row_of[request_id] = self.free_rows.pop(0)
            self.num_tokens[request_id] = 0
        return True

    def mark_computed(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                      prev_computed: int = 0) -> None:
        if request_id in self.row_of:
            self.num_tokens[request_id] = num_computed

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """A row stays reserved whole; only the count of held tokens shrinks."""
        if request_id in self.num_tokens:
            self.num_tokens[request_id] = min(self.num_tokens[request_id], num_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        raise ValueError("parallel sampling (n > 1) forks sequences and needs the paged KV cache "
                         "(kv_layout='paged')")

    def _no_swap(self, *args, **kwargs):
        raise ValueError("swap preemption needs the paged KV cache (kv_layout='paged')")

    swap_out = can_swap_in = swap_in = _no_swap

    def free(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        self.num_tokens.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)
            self.free_rows.sort()

    def block_table(self, request_id: str) -> list[int]:
        return [self.row_of[request_id]]

    def first_block(self, request_id: str) -> int:
        return self.row_of.get(request_id, -1)

    # --- memory accounting -------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved by the requests that hold a row now."""
        return len(self.row_of) * self.bytes_per_block

    @property
    def used_bytes(self) -> int:
        """Bytes holding real tokens of the requests that hold a row now."""
        return sum(self.num_tokens.values()) * self.bytes_per_token
