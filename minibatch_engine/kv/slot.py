"""Slot KV cache: every admitted request reserves ``max_model_len`` tokens up front.

This is how padded ``generate``, FasterTransformer-style static batching and
Orca reserve memory: one contiguous row of the cache per sequence, sized for the
longest sequence the model may ever produce, whatever this request will need.
In the pool's terms each slot is one block of ``max_model_len`` tokens.
"""
from __future__ import annotations

import torch

from .base import KVCacheManager
from .pool import KVPool


class SlotKVCache(KVCacheManager):
    """A fixed number of slots, each a reservation of ``max_model_len`` tokens."""

    def __init__(self, model_config, num_slots: int, max_model_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.max_model_len = max_model_len
        self.pool = KVPool(model_config.num_layers, num_slots, max_model_len,
                           model_config.num_kv_heads, model_config.head_dim, dtype, device)
        self.block_size = max_model_len
        self.free_slots: list[int] = list(range(num_slots))
        self.slot_of: dict[str, int] = {}        # request_id -> slot
        self.num_tokens: dict[str, int] = {}     # request_id -> tokens held

    # --- the interface every KV manager offers the scheduler -------------------
    @property
    def num_slots(self) -> int:
        return self.pool.num_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def max_tokens_per_request(self) -> int:
        return self.max_model_len

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Could ``request_id`` hold ``num_tokens`` tokens after an ``allocate``?"""
        if num_tokens > self.max_model_len:
            return False
        return request_id in self.slot_of or bool(self.free_slots)

    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                 admit: bool = False) -> bool:
        """Make room for ``num_tokens`` tokens of ``request_id`` (reserving a whole
        slot the first time). Returns False, changing nothing, when it cannot."""
        if not self.can_allocate(request_id, num_tokens):
            return False
        if request_id not in self.slot_of:
            self.slot_of[request_id] = self.free_slots.pop(0)
            self.num_tokens[request_id] = 0
        return True

    def match_prefix(self, request_id: str, token_ids) -> int:
        return 0          # a slot cache shares nothing

    def mark_computed(self, request_id: str, token_ids, num_computed: int, prev_computed: int = 0) -> None:
        """The first ``num_computed`` tokens of the request now have K/V."""
        if request_id in self.slot_of:
            self.num_tokens[request_id] = num_computed

    def fork(self, parent_id: str, child_id: str) -> None:
        raise ValueError("parallel sampling (n > 1) needs the paged KV cache (kv_cache='paged')")

    def holds(self, request_id: str) -> bool:
        return request_id in self.slot_of

    def free(self, request_id: str) -> None:
        """Give a request's slot back (no-op for an unknown request)."""
        slot = self.slot_of.pop(request_id, None)
        self.num_tokens.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.free_slots.sort()

    def block_table(self, request_id: str) -> list[int]:
        return [self.slot_of[request_id]]

    # --- memory accounting -------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved by the requests that hold a slot now."""
        return len(self.slot_of) * self.pool.bytes_per_block

    @property
    def used_bytes(self) -> int:
        """Bytes holding real tokens of the requests that hold a slot now."""
        return sum(self.num_tokens.values()) * self.pool.bytes_per_token

    @property
    def num_used_slots(self) -> int:
        return len(self.slot_of)
