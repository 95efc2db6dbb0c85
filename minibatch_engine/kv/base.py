"""The one interface every KV-cache manager offers (an abstract base class).

A manager is the scheduler's bookkeeping of KV memory: which blocks of the
physical pool each request owns, and how many bytes that is. It holds no
tensor. The pool itself (:class:`~.pool.KVPool`) belongs to the model runner,
which writes it in the forward pass and carries out the block copies the
manager decides (copy-on-write of a shared block, swaps to and from host
memory): the manager queues them as :class:`~minibatch_engine.core.outputs.BlockCopy`
instructions, and the scheduler hands them over in the step's
``SchedulerOutput`` (:meth:`take_block_copies`). A manager knows request ids
and token ids, never a ``Request``.

Two implementations:

* :class:`~.reserved.ReservedKVCache`: one row of ``max_model_len`` tokens per
  request, reserved at admission (Orca, padded ``generate``);
* :class:`~.paged.PagedKVCache`: ``block_size``-token blocks taken as a sequence
  grows, shared through a prefix cache and copy-on-write (PagedAttention).

Prefix reuse is two calls, as in vLLM: :meth:`find_cached_prefix` only looks
(no side effect), and :meth:`allocate` commits what was found together with the
new blocks, or changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from abc import ABC, abstractmethod
from typing import Sequence

import torch

from ..core.outputs import BlockCopy
from .quant import kv_bytes_per_token


@dataclass(frozen=True)
class CachedPrefix:
    """Full blocks found in the prefix cache for a token sequence."""
    block_ids: tuple[int, ...] = field(default_factory=tuple)
    num_tokens: int = 0

    def __bool__(self) -> bool:
        return self.num_tokens > 0


NO_PREFIX = CachedPrefix()


class KVCacheManager(ABC):
    """The scheduler's bookkeeping of KV memory (see the module docstring).

    Implemented here, for both managers: the byte sizes of the pool they account
    for (computed from the model's shape; no memory is taken) and the queue of
    block copies for the runner. Each manager implements the rest."""

    watermark_blocks: int = 0   # blocks admission keeps free for running requests to grow

    def __init__(self, model_config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 kv_cache_dtype: str = "auto"):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.kv_cache_dtype = kv_cache_dtype
        self.bytes_per_token = kv_bytes_per_token(model_config, dtype, kv_cache_dtype)
        self._num_blocks, self.block_size = num_blocks, block_size
        self._copies: list[BlockCopy] = []

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def capacity_bytes(self) -> int:
        """The whole pool: what the runner's :class:`~.pool.KVPool` takes from device memory."""
        return self.bytes_per_block * self._num_blocks

    def take_block_copies(self) -> list[BlockCopy]:
        """The block copies queued since the last call, in order (and forget them)."""
        copies, self._copies = self._copies, []
        return copies

    def record_kv_events(self) -> None:
        """Record KV-cache events (:mod:`.events`) from now on; only a paged cache
        with prefix caching has a prefix cache to report."""
        raise ValueError(f"KV-cache events need the paged KV cache with prefix caching, "
                         f"not {type(self).__name__}")

    def take_kv_events(self) -> list:
        """The KV-cache events recorded since the last call, in order (and forget them)."""
        return []

    @abstractmethod
    def max_tokens_per_request(self) -> int:
        """The most tokens one request can ever hold."""

    @abstractmethod
    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: list[int] | None = None) -> CachedPrefix:
        """The cached full blocks ``token_ids`` start with (never the last token,
        whose logits are needed). Looks only: nothing is taken. ``block_hashes``:
        the request's own cache of its blocks' hashes, extended in place."""

    @abstractmethod
    def allocate(self, request_id: str, num_tokens: int, num_computed_tokens: int = 0,
                 prefix: CachedPrefix = NO_PREFIX, headroom: int = 0) -> bool:
        """Make ``request_id`` hold ``num_tokens`` tokens, of which those from
        ``num_computed_tokens`` on will be written this step (a block shared with
        another request is copied first). ``prefix`` (a new request only) is
        committed first. Fails, changing nothing, if fewer than ``headroom`` free
        blocks would be left."""

    @abstractmethod
    def mark_computed(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                      prev_computed: int = 0) -> None:
        """Tokens ``prev_computed .. num_computed - 1`` of the request now have K/V."""

    @abstractmethod
    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` token slots of the request: those after
        them (speculative tokens the target rejected) are given back, whole
        trailing blocks freed."""

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` shares every block of ``parent_id`` (parallel sampling)."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Give back everything ``request_id`` holds (no-op for an unknown id)."""

    @abstractmethod
    def swap_out(self, request_id: str, swap) -> int:
        """Move the request's blocks to host ``swap`` space (the copies queued for
        the runner) and free them; returns bytes."""

    @abstractmethod
    def can_swap_in(self, swap, request_id: str, headroom: int = 0) -> bool:
        """Room to bring the request's swapped blocks back, ``headroom`` blocks spare."""

    @abstractmethod
    def swap_in(self, request_id: str, swap, token_ids: Sequence[int], num_computed: int) -> int:
        """Bring a swapped-out request back into fresh blocks (the copies queued
        for the runner); returns bytes."""

    @abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        """Physical blocks of the request, in order."""

    @abstractmethod
    def first_block(self, request_id: str) -> int:
        """The request's first block (its row, for a reserved cache); -1 if it holds none."""

    @property
    @abstractmethod
    def num_used_blocks(self) -> int:
        """Blocks (rows) some request holds now."""

    @property
    @abstractmethod
    def reserved_bytes(self) -> int:
        """Bytes of the blocks some request holds now."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of those that hold a token."""
