"""Attention metadata for one forward over a ragged batch.

The model sees a flat list of ``T`` new tokens from ``S`` sequences. For sequence
``s`` the metadata says how many new tokens it brings (``query_lens[s]``), how many
tokens its queries attend to once those are written (``seq_lens[s]``: cached
context plus the new tokens) and where each new token's K/V goes in the cache
(``slot_mapping``, a flat slot index = block * block_size + offset). With that, one
forward serves a prefill, a decode step, a prefill chunk or any mix of them.

:class:`BatchMetadata` holds what every backend needs (:func:`batch_fields`
checks and builds it); each backend extends it with its own layout and records
itself in ``backend``. :class:`AttentionMetadata` is the reference backend's.

The reference pads sequences to a common query and context length. To keep
that padding small, sequences are split into *groups*: decode sequences (one
query each) are padded only among themselves, and multi-token sequences
(prefills, chunks) among themselves; a decode token is never padded to the
length of a prompt. Everything here is computed once per step and shared by all
layers, so the layers only gather, multiply and scatter.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Sequence

import torch


@dataclass(kw_only=True)
class BatchMetadata:
    """What every attention backend needs to know about a step's ragged batch.

    Built once per step on the host, moved to the device once, read by every
    layer. Backends extend it with their own precomputed layout (the reference
    adds padded groups; the fast CPU path adds length buckets) and record
    themselves in ``backend``, so the model calls the backend that built it.
    """
    query_lens: torch.Tensor        # [S] new tokens per sequence
    seq_lens: torch.Tensor          # [S] context length after this step's tokens
    query_start_loc: torch.Tensor   # [S+1] offsets of each sequence in the flat batch
    slot_mapping: torch.Tensor | None   # [T] cache slot of each new token (None: no cache)
    block_tables: torch.Tensor | None   # [S, max_blocks] physical block ids
    block_size: int
    logits_indices: torch.Tensor    # [S] the last new token of each sequence
    max_query_len: int
    max_seq_len: int
    backend: Any = None             # the AttentionBackend whose forward reads this metadata

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.numel())


def batch_fields(query_lens: Sequence[int], seq_lens: Sequence[int],
                 block_tables: Sequence[Sequence[int]] | None, block_size: int) -> dict:
    """Check a batch's lengths and block tables; return :class:`BatchMetadata`'s
    fields as host tensors (``slot_mapping`` included: slot of the token at
    position p of sequence s = ``block_tables[s][p // block_size] * block_size +
    p % block_size``).

    ``block_tables=None`` means "no cache": every sequence attends only to its
    own new tokens (``seq_lens`` must equal ``query_lens``), as in a full
    recompute. Otherwise the new tokens of sequence ``s`` occupy positions
    ``seq_lens[s] - query_lens[s] ... seq_lens[s] - 1``.
    """
    query_lens, seq_lens = list(map(int, query_lens)), list(map(int, seq_lens))
    if len(query_lens) != len(seq_lens) or len(query_lens) == 0:
        raise ValueError("query_lens and seq_lens must be non-empty and of equal length")
    if min(query_lens) <= 0 or any(map(int.__lt__, seq_lens, query_lens)):
        q, n = next((q, n) for q, n in zip(query_lens, seq_lens) if q <= 0 or n < q)
        raise ValueError(f"bad lengths: query_len={q}, seq_len={n}")
    S = len(query_lens)
    qstart_list = [0, *accumulate(query_lens)]
    ql, sl, qstart = long_tensor(query_lens), long_tensor(seq_lens), long_tensor(qstart_list)
    bt = slot_mapping = None
    if block_tables is None:
        if any(q != n for q, n in zip(query_lens, seq_lens)):
            raise ValueError("without a cache every sequence attends only to its new tokens")
    else:
        if block_size <= 0:
            raise ValueError("block_size must be positive with block tables")
        if len(block_tables) != S:
            raise ValueError(f"{len(block_tables)} block tables for {S} sequences")
        width = max(map(len, block_tables))
        slots: list[int] = []      # built in Python: a step has at most a few thousand new tokens
        flat: list[int] = []       # the tables, zero padded to [S, width], row after row
        zeros = [0] * width
        for s, blocks in enumerate(block_tables):
            blocks = blocks if isinstance(blocks, list) else [int(x) for x in blocks]
            n, q = seq_lens[s], query_lens[s]
            if len(blocks) < -(-n // block_size):
                raise ValueError(f"sequence {s} needs {-(-n // block_size)} blocks, block table has {len(blocks)}")
            if q == 1:                                          # a decode: one slot
                slots.append(blocks[(n - 1) // block_size] * block_size + (n - 1) % block_size)
            else:
                slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n - q, n)]
            flat += blocks
            flat += zeros[len(blocks):]
        bt = long_tensor(flat).view(S, width)
        slot_mapping = long_tensor(slots)
    return dict(query_lens=ql, seq_lens=sl, query_start_loc=qstart, slot_mapping=slot_mapping,
                block_tables=bt, block_size=block_size,
                logits_indices=long_tensor([q - 1 for q in qstart_list[1:]]),
                max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def long_tensor(values: list[int]) -> torch.Tensor:
    """An int64 tensor of ``values``, through a C array (several times faster than
    ``torch.tensor`` on a Python list: this runs every step)."""
    return torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.zeros(0, dtype=torch.long)


def to_device(fields: dict, device) -> dict:
    """The same fields with every tensor moved to ``device`` (one copy each)."""
    dev = torch.device(device)
    return {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in fields.items()}
