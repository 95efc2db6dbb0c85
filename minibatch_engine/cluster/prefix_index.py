"""The router's own record of what each replica's prefix cache holds.

A router in front of HTTP servers cannot look into their caches. It can
remember what it sent where: the chained hashes of each prompt's full blocks
(the same hashes a paged cache keys its blocks by), per replica, the most
recent ``capacity_blocks`` of them. A later prompt's expected hit on a replica
is its longest run of leading blocks found there. The record is approximate:
a replica may have evicted a block the router still lists, and it cannot list
blocks a request has yet to compute. SGLang's router keeps such a tree per
worker; llm-d's default prefix scorer does the same. The exact alternative
reads the caches themselves (llm-d's precise scorer, Dynamo's KV router:
both from the engines' KV events); the simulator can do that too
(``prefix_source="replica"`` in :func:`~.replicas.simulate_cluster`).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from ..kv.block_manager import chain_hash


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks, as the paged cache computes
    them (its last token is never served from a cache, so neither is a block
    that ends on it)."""
    out: list[int] = []
    for i in range((len(token_ids) - 1) // block_size):
        out.append(chain_hash(out[-1] if out else None, tuple(token_ids[i * block_size:(i + 1) * block_size])))
    return out


class PrefixIndex:
    """Per replica, the block hashes of prompts routed there (least recently
    routed dropped first beyond ``capacity_blocks``)."""

    def __init__(self, num_replicas: int, block_size: int = 16, capacity_blocks: int = 1 << 20):
        if num_replicas < 1 or block_size < 1 or capacity_blocks < 1:
            raise ValueError(f"num_replicas, block_size and capacity_blocks must be >= 1, got "
                             f"{num_replicas}, {block_size}, {capacity_blocks}")
        self.block_size, self.capacity_blocks = block_size, capacity_blocks
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def match(self, token_ids: Sequence[int], hashes: list[int] | None = None) -> list[int]:
        """Tokens of ``token_ids`` expected in each replica's cache (one count per replica)."""
        hashes = block_hashes(token_ids, self.block_size) if hashes is None else hashes
        out = []
        for held in self.blocks:
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            out.append(n * self.block_size)
        return out

    def record(self, replica: int, token_ids: Sequence[int], hashes: list[int] | None = None) -> None:
        """Remember that ``token_ids`` went to ``replica``."""
        held = self.blocks[replica]
        for h in block_hashes(token_ids, self.block_size) if hashes is None else hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)
