"""KV-cache events: what a router needs to know of one replica's prefix cache.

A KV-aware router (vllm-router's ``kv_aware`` policy, llm-d's KV-cache-aware
scheduler) sends a request to the replica that already holds most of its
prompt. It learns what each replica holds from three events, vLLM's
(``vllm/distributed/kv_events.py``), which the block manager records when
asked to (:meth:`~.block_manager.BlockManager.record_events`):

* :class:`BlockStored`: full blocks entered the prefix cache, a chain of them
  (each the child of the one before; the first the child of
  ``parent_block_hash``, ``None`` at a prompt's start), with their tokens;
* :class:`BlockRemoved`: cached blocks left it (evicted when the free list
  handed them out again, or forgotten with an evicted parent);
* :class:`AllBlocksCleared`: the whole prefix cache was reset.

The hashes are the engine's own (:func:`~.block_manager.chain_hash`): opaque
names that let a subscriber match a removal to its store. These records are
plain data; the wire format lives with the publisher
(:mod:`minibatch_engine.entrypoints.server.kv_events`).
"""
from __future__ import annotations

from dataclasses import dataclass

MEDIUM_DEVICE = "GPU"   # vLLM's name for the engine's own KV pool (its "CPU" means an offload tier)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks registered in the prefix cache, in sequence order."""
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]          # len(block_hashes) * block_size tokens
    block_size: int
    lora_id: int | None = None
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer findable in the prefix cache."""
    block_hashes: tuple[int, ...]
    medium: str = MEDIUM_DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block forgotten at once."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
