"""The block manager of a paged KV cache: pure bookkeeping, no tensors.

PagedAttention's memory is a pool of fixed-size blocks. The block manager
decides which physical block holds which part of which sequence:

* a free list of blocks, least recently freed first;
* per-request block tables (logical block i -> physical block id);
* reference counts, so one physical block can belong to several sequences
  (a shared prompt prefix, or the samples of one prompt);
* a prefix cache: a full block's identity is the hash of its tokens chained
  with the hash of the block before it. A request whose prompt starts with
  cached blocks reuses them instead of recomputing them. Every hit is verified
  against the block's stored tokens and its parent block, and a block's cached
  children are forgotten when it is reused, so a hash collision can cost a
  miss, never a wrong token.

Freed blocks that hold a cached prefix stay findable until the free list hands
them out again (evicting the oldest first).

Asked to (:meth:`BlockManager.record_events`), it records vLLM's KV-cache
events (:mod:`.events`) as blocks enter and leave the prefix cache, for a
KV-aware router; unasked, it records nothing and costs nothing.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


def chain_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """Identity of a full block: its tokens chained with its prefix's identity."""
    return hash((parent_hash, tokens))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    num_filled: int = 0                    # tokens written (for memory accounting)
    hash: int | None = None                # set once full and registered in the prefix cache
    tokens: tuple[int, ...] | None = None  # the tokens it holds, for hit verification
    parent: int | None = None              # the physical block before it in its sequence
    children: set = field(default_factory=set)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: Callable[[int | None, tuple[int, ...]], int] = chain_hash):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.hash_fn = enable_prefix_caching, hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}                 # hash -> block id
        self.block_tables: dict[str, list[int]] = {}
        self.num_cow_copies = 0
        self._used_tokens = 0     # sum of num_filled over referenced blocks, kept up to date
        self.events: list[KVCacheEvent] | None = None     # None: events off (record_events turns them on)

    # --- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def table(self, request_id: str) -> list[int]:
        """The block table of ``request_id`` (KeyError if it holds none)."""
        return self.block_tables[request_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.block_tables.get(request_id, ())))

    # --- KV-cache events -------------------------------------------------------------
    def record_events(self) -> None:
        """From now on, record a :class:`~.events.BlockStored` when full blocks
        enter the prefix cache, a :class:`~.events.BlockRemoved` when one leaves
        it, an :class:`~.events.AllBlocksCleared` on :meth:`reset_prefix_cache`."""
        if not self.enable_prefix_caching:
            raise ValueError("KV-cache events need prefix caching (enable_prefix_caching=True)")
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, in order (and forget them)."""
        events = self.events or []
        if self.events:
            self.events = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``, e.g. after new
        weights are loaded). Refused (returns False) while any request holds a block."""
        if self.num_used_blocks:
            return False
        for block_id in self.cached.values():
            b = self.blocks[block_id]
            b.hash = b.tokens = b.parent = None
            b.children.clear()
            b.num_filled = 0
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    # --- allocation ------------------------------------------------------------------
    def _take_free(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)      # least recently freed
        self._uncache(block_id)
        b = self.blocks[block_id]
        b.ref_count, b.num_filled = 1, 0
        return block_id

    def _uncache(self, block_id: int) -> None:
        """Forget a block's prefix identity, and (recursively) its cached children's,
        whose K/V were computed after this block's old content."""
        b = self.blocks[block_id]
        if b.hash is not None and self.cached.get(b.hash) == block_id:
            del self.cached[b.hash]
            if self.events is not None:
                self.events.append(BlockRemoved((b.hash,)))
        if b.parent is not None:
            self.blocks[b.parent].children.discard(block_id)
        b.hash = b.tokens = b.parent = None
        for child in list(b.children):
            self._uncache(child)
        b.children.clear()

    def block_hashes(self, token_ids: Sequence[int], num_blocks: int, hashes: list[int]) -> list[int]:
        """The chained hashes of the first ``num_blocks`` full blocks of
        ``token_ids``: ``hashes`` (a request's own cache of them, vLLM's
        ``request.block_hashes``) extended in place as far as needed. A request's
        known tokens never change, so each block is hashed once in its life."""
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(self.hash_fn(hashes[-1] if hashes else None, tuple(token_ids[i * bs:(i + 1) * bs])))
        return hashes

    def find_cached_prefix(self, token_ids: Sequence[int],
                           hashes: list[int] | None = None) -> tuple[list[int], int]:
        """The cached full blocks ``token_ids`` start with, and how many tokens
        they hold. Looks only: no reference is taken, nothing leaves the free
        list. The last token is never taken from the cache (its logits are
        needed). ``hashes``: the request's cached block hashes (see
        :meth:`block_hashes`), so a request that waits is not hashed again every
        step. Every hit is verified against the stored tokens and parent."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        hashes = self.block_hashes(token_ids, (len(token_ids) - 1) // bs, [] if hashes is None else hashes)
        found, parent = [], None
        for i in range((len(token_ids) - 1) // bs):
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                break
            b = self.blocks[block_id]
            if b.parent != parent or b.tokens != tuple(token_ids[i * bs:(i + 1) * bs]):   # a collision: a miss
                break
            found.append(block_id)
            parent = block_id
        return found, len(found) * bs

    def num_blocks_to_copy(self, request_id: str, first_pos: int) -> int:
        """Shared blocks ``request_id`` would write into from ``first_pos`` on."""
        table = self.block_tables.get(request_id, ())
        blocks, n = self.blocks, 0
        for i in range(first_pos // self.block_size, len(table)):
            n += blocks[table[i]].ref_count > 1
        return n

    def num_revived(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` sit on the free list (cached, unreferenced)."""
        return sum(self.blocks[b].ref_count == 0 for b in block_ids)

    def allocate(self, request_id: str, num_tokens: int, prefix: Sequence[int] = (),
                 headroom: int = 0) -> bool:
        """Grow ``request_id``'s table to hold ``num_tokens`` tokens; a request with
        no blocks yet first takes the cached ``prefix`` blocks (found by
        :meth:`find_cached_prefix`). Fails, changing nothing, if that would leave
        fewer than ``headroom`` free blocks."""
        table = self.block_tables.get(request_id)
        if table and not prefix and -(-num_tokens // self.block_size) <= len(table):
            return True                                      # fits already (most decode steps)
        if prefix and table:
            raise ValueError(f"request {request_id!r} already holds blocks; a prefix is for new requests")
        need = max(0, self.blocks_for(num_tokens) - (len(table) if table else len(prefix)))
        if need + self.num_revived(prefix) > self.num_free_blocks - headroom:
            return False
        table = self.block_tables.setdefault(request_id, [])
        for block_id in prefix:
            b = self.blocks[block_id]
            if b.ref_count == 0:
                del self.free_blocks[block_id]                        # revive a freed cached block
                self._used_tokens += b.num_filled
            b.ref_count += 1
            table.append(block_id)
        table.extend(self._take_free() for _ in range(need))
        return True

    def mark_computed(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                      prev_computed: int = 0) -> None:
        """Record that tokens ``prev_computed .. num_computed - 1`` now have K/V: fill
        counts, and register blocks that became full in the prefix cache."""
        table = self.block_tables.get(request_id, [])
        bs = self.block_size
        i = prev_computed // bs
        if num_computed - prev_computed == 1 and num_computed % bs and i < len(table):
            b = self.blocks[table[i]]        # one token, its block not yet full (most decodes)
            filled = num_computed - i * bs
            if filled > b.num_filled:
                self._used_tokens += filled - b.num_filled
                b.num_filled = filled
            return
        stored = [] if self.events is not None else None       # (index, hash) of blocks registered now
        for i in range(i, min(len(table), -(-num_computed // bs))):
            b = self.blocks[table[i]]
            filled = max(b.num_filled, min(bs, num_computed - i * bs))
            self._used_tokens += filled - b.num_filled
            b.num_filled = filled
            if b.num_filled < bs or b.hash is not None or not self.enable_prefix_caching:
                continue
            parent = table[i - 1] if i > 0 else None
            parent_hash = self.blocks[parent].hash if parent is not None else None
            if parent is not None and parent_hash is None:
                continue              # its prefix is not cached, so neither is it
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self.hash_fn(parent_hash, tokens)
            if h in self.cached:      # the same content is cached already (or a collision)
                continue
            b.hash, b.tokens, b.parent = h, tokens, parent
            self.cached[h] = b.block_id
            if parent is not None:
                self.blocks[parent].children.add(b.block_id)
            if stored is not None:
                stored.append((i, h))
        if stored:
            self._record_stored(table, token_ids, stored)

    def _record_stored(self, table: list[int], token_ids: Sequence[int], stored: list[tuple[int, int]]) -> None:
        """One BlockStored per chain of consecutive blocks one call registered (a
        block registers only after its parent, so there is one chain), as vLLM
        reports them: the chain's hashes, its parent's hash, its tokens."""
        bs, start = self.block_size, 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k][0] == stored[k - 1][0] + 1:
                continue
            first, last = stored[start][0], stored[k - 1][0]
            parent_hash = self.blocks[table[first - 1]].hash if first > 0 else None
            self.events.append(BlockStored(tuple(h for _, h in stored[start:k]), parent_hash,
                                           tuple(token_ids[first * bs:(last + 1) * bs]), bs))
            start = k

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (copy-on-write later)."""
        if child_id in self.block_tables:
            raise ValueError(f"request {child_id!r} already has blocks")
        table = list(self.block_tables[parent_id])
        for block_id in table:
            self.blocks[block_id].ref_count += 1
        self.block_tables[child_id] = table

    def copy_on_write(self, request_id: str, first_pos: int) -> list[tuple[int, int]]:
        """Before ``request_id`` writes tokens from position ``first_pos`` on, give it
        a private copy of every shared block it will write into. Returns the
        (source, destination) block pairs whose contents must be copied."""
        table = self.block_tables[request_id]
        copies = []
        for i in range(first_pos // self.block_size, len(table)):
            src = self.blocks[table[i]]
            if src.ref_count > 1:
                if not self.free_blocks:
                    raise RuntimeError("no free block for copy-on-write")
                dst = self._take_free()
                self.blocks[dst].num_filled = src.num_filled
                self._used_tokens += src.num_filled
                src.ref_count -= 1
                table[i] = dst
                copies.append((src.block_id, dst))
        self.num_cow_copies += len(copies)
        return copies

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Drop the request's blocks past its first ``num_tokens`` tokens (speculative
        rollback). Those blocks were written this step after the accepted tokens,
        so none holds a registered prefix; the last kept block's fill is trimmed."""
        table = self.block_tables.get(request_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._drop(table.pop())
        if table:
            last = self.blocks[table[-1]]
            filled = min(last.num_filled, num_tokens - (len(table) - 1) * self.block_size)
            if last.ref_count > 0:
                self._used_tokens += filled - last.num_filled
            last.num_filled = filled

    def _drop(self, block_id: int) -> None:
        """One reference fewer; a block nobody holds returns to the free list
        (keeping its cached identity until it is handed out again)."""
        b = self.blocks[block_id]
        b.ref_count -= 1
        if b.ref_count == 0:
            self._used_tokens -= b.num_filled
            if b.hash is None:
                b.num_filled = 0
            self.free_blocks[block_id] = None

    def free_request(self, request_id: str) -> None:
        """Drop a request's references; blocks nobody holds return to the free list
        (keeping their cached identity until they are handed out again)."""
        for block_id in reversed(self.block_tables.pop(request_id, [])):
            self._drop(block_id)

    # --- accounting ------------------------------------------------------------------
    def used_tokens(self) -> int:
        """Tokens held in blocks some request references (a shared block counts once).
        Kept as a running count (read every step); ``check_invariants`` recounts it."""
        return self._used_tokens

    def _count_used_tokens(self) -> int:
        in_use = set().union(*self.block_tables.values()) if self.block_tables else set()
        return sum(self.blocks[i].num_filled for i in in_use)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        refs = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                refs[block_id] += 1
        for b in self.blocks:
            assert b.ref_count == refs[b.block_id], f"block {b.block_id}: ref {b.ref_count} != {refs[b.block_id]}"
            assert (b.ref_count == 0) == (b.block_id in self.free_blocks), f"block {b.block_id} free-list mismatch"
            assert b.ref_count >= 0
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h
        assert self._used_tokens == self._count_used_tokens(), \
            f"used-token count {self._used_tokens} != {self._count_used_tokens()}"
