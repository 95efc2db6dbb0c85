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


@dataclass
class AttentionGroup:
    """Sequences attended together, padded to ``max_query_len`` x ``max_seq_len``."""
    token_index: torch.Tensor | None   # [Tg] the group's tokens in the flat batch (None: all, in order)
    query_index: torch.Tensor          # [Tg] each token's place in the padded [Sg * Qmax] layout
    context_index: torch.Tensor        # [Sg, Lmax] where key position p of each sequence is read from
    mask: torch.Tensor                 # [Sg, Qmax, Lmax] True where query i may attend key p
    num_seqs: int
    max_query_len: int
    max_seq_len: int


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


@dataclass(kw_only=True)
class AttentionMetadata(BatchMetadata):
    """The reference backend's metadata: the batch plus padded groups."""
    groups: list[AttentionGroup]    # decode sequences and multi-token sequences, padded apart

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]] | None = None,
              block_size: int = 0, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Build the metadata for a batch (see :func:`batch_fields` for the
        arguments). Decode sequences and multi-token sequences are padded apart."""
        from .reference import REFERENCE   # the backend that reads this layout

        fields = batch_fields(query_lens, seq_lens, block_tables, block_size)
        ql, sl, qstart, bt = (fields[k] for k in ("query_lens", "seq_lens", "query_start_loc",
                                                  "block_tables"))
        S = len(query_lens)
        decode = [s for s in range(S) if query_lens[s] == 1]
        multi = [s for s in range(S) if query_lens[s] > 1]
        parts = [g for g in (decode, multi) if g]
        groups = [_build_group(seqs, ql, sl, qstart, bt, block_size, whole=len(parts) == 1)
                  for seqs in parts]
        dev = torch.device(device)
        move = lambda t: None if t is None else t.to(dev, non_blocking=True)  # noqa: E731
        for g in groups:
            g.token_index, g.query_index = move(g.token_index), move(g.query_index)
            g.context_index, g.mask = move(g.context_index), move(g.mask)
        return cls(**to_device(fields, dev), groups=groups, backend=REFERENCE)


def _build_group(seqs, ql_all, sl_all, qstart_all, bt, block_size, whole):
    """Padded layout of the sequences ``seqs``: which token goes where, which
    cache slot each key position is read from, and the causal mask."""
    idx = torch.tensor(seqs, dtype=torch.long)
    ql, sl, qs = ql_all[idx], sl_all[idx], qstart_all[idx]
    S, qmax, lmax = len(seqs), int(ql.max()), int(sl.max())
    seq_of_token = torch.repeat_interleave(torch.arange(S), ql)             # [Tg]
    starts = torch.zeros(S, dtype=torch.long)
    starts[1:] = torch.cumsum(ql, 0)[:-1]
    offset_in_seq = torch.arange(int(ql.sum())) - starts[seq_of_token]      # [Tg]
    token_index = qs[seq_of_token] + offset_in_seq                          # flat positions
    query_index = seq_of_token * qmax + offset_in_seq

    key_pos = torch.arange(lmax)                                            # [Lmax]
    q_pos = (sl - ql)[:, None] + torch.arange(qmax)[None, :]                # [S, Qmax]
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < sl[:, None, None])
    # Rows beyond a sequence's queries are padding: let them see key 0 so softmax
    # stays finite; their outputs are never read.
    pad_rows = torch.arange(qmax)[None, :] >= ql[:, None]
    mask[pad_rows] = False
    mask[..., 0] |= pad_rows

    if bt is None:      # keys are this step's own tokens, read from the flat batch
        context_index = (qs[:, None] + key_pos[None, :]).clamp(max=int(qstart_all[-1]) - 1)
    else:
        table = bt[idx]
        blk = (key_pos // block_size).clamp(max=table.shape[1] - 1)
        context_index = table[:, blk] * block_size + (key_pos % block_size)[None, :]
    return AttentionGroup(None if whole else token_index, query_index, context_index, mask,
                          S, qmax, lmax)
