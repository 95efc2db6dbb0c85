"""Attention metadata for one forward over a ragged batch.

The model sees a flat list of ``T`` new tokens from ``S`` sequences. For sequence
``s`` the metadata says how many new tokens it brings (``query_lens[s]``), how many
tokens its queries attend to once those are written (``seq_lens[s]``: cached
context plus the new tokens) and where each new token's K/V goes in the cache
(``slot_mapping``, a flat slot index = block * block_size + offset). With that, one
forward serves a prefill, a decode step, a prefill chunk or any mix of them.

Everything per-layer-invariant is computed once here, so the layers themselves
only gather, multiply and scatter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class AttentionMetadata:
    query_lens: torch.Tensor        # [S] new tokens per sequence
    seq_lens: torch.Tensor          # [S] context length after this step's tokens
    query_start_loc: torch.Tensor   # [S+1] offsets of each sequence in the flat batch
    slot_mapping: torch.Tensor | None   # [T] cache slot of each new token (None: no cache)
    block_tables: torch.Tensor | None   # [S, max_blocks] physical block ids
    block_size: int
    # Derived, shared by every layer:
    context_index: torch.Tensor     # [S, Lmax] where key position p of seq s is read from
    query_index: torch.Tensor       # [T] position of each token in the padded [S*Qmax] layout
    mask: torch.Tensor              # [S, Qmax, Lmax] True where query i may attend key p
    logits_indices: torch.Tensor    # [S] the last new token of each sequence
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.query_index.numel())

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]] | None = None,
              block_size: int = 0, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Build the metadata for a batch.

        ``block_tables=None`` means "no cache": every sequence attends only to its
        own new tokens (``seq_lens`` must equal ``query_lens``), as in a full
        recompute. Otherwise ``block_tables[s]`` lists the physical blocks of
        sequence ``s`` and the new tokens occupy positions
        ``seq_lens[s] - query_lens[s] ... seq_lens[s] - 1``.
        """
        if len(query_lens) != len(seq_lens) or len(query_lens) == 0:
            raise ValueError("query_lens and seq_lens must be non-empty and of equal length")
        for q, n in zip(query_lens, seq_lens):
            if q <= 0 or n < q:
                raise ValueError(f"bad lengths: query_len={q}, seq_len={n}")
        S = len(query_lens)
        qmax, lmax = max(query_lens), max(seq_lens)
        ql = torch.tensor(list(query_lens), dtype=torch.long)
        sl = torch.tensor(list(seq_lens), dtype=torch.long)
        qstart = torch.zeros(S + 1, dtype=torch.long)
        qstart[1:] = torch.cumsum(ql, 0)
        T = int(qstart[-1])

        seq_of_token = torch.repeat_interleave(torch.arange(S), ql)          # [T]
        offset_in_seq = torch.arange(T) - qstart[:-1][seq_of_token]         # [T]
        query_index = seq_of_token * qmax + offset_in_seq

        key_pos = torch.arange(lmax)                                         # [Lmax]
        q_pos = (sl - ql)[:, None] + torch.arange(qmax)[None, :]             # [S, Qmax]
        mask = key_pos[None, None, :] <= q_pos[:, :, None]                   # causal
        mask &= key_pos[None, None, :] < sl[:, None, None]                   # own length
        # Rows beyond a sequence's queries are padding: let them see key 0 so
        # softmax stays finite; their outputs are never read.
        pad_rows = torch.arange(qmax)[None, :] >= ql[:, None]
        mask[pad_rows] = False
        mask[..., 0] |= pad_rows

        if block_tables is None:
            if any(q != n for q, n in zip(query_lens, seq_lens)):
                raise ValueError("without a cache every sequence attends only to its new tokens")
            context_index = (qstart[:-1][:, None] + key_pos[None, :]).clamp_(max=max(T - 1, 0))
            slot_mapping = bt = None
        else:
            if block_size <= 0:
                raise ValueError("block_size must be positive with block tables")
            width = max(len(b) for b in block_tables)
            bt = torch.zeros(S, width, dtype=torch.long)
            for s, blocks in enumerate(block_tables):
                need = -(-seq_lens[s] // block_size)
                if len(blocks) < need:
                    raise ValueError(f"sequence {s} needs {need} blocks, block table has {len(blocks)}")
                bt[s, :len(blocks)] = torch.tensor(list(blocks), dtype=torch.long)
            blk = (key_pos // block_size).clamp(max=width - 1)
            context_index = bt[:, blk] * block_size + (key_pos % block_size)[None, :]
            pos_of_token = (sl - ql)[seq_of_token] + offset_in_seq
            slot_mapping = context_index[seq_of_token, pos_of_token]

        dev = torch.device(device)
        move = lambda t: None if t is None else t.to(dev, non_blocking=True)  # noqa: E731
        return cls(
            query_lens=move(ql), seq_lens=move(sl), query_start_loc=move(qstart),
            slot_mapping=move(slot_mapping), block_tables=move(bt), block_size=block_size,
            context_index=move(context_index), query_index=move(query_index),
            mask=move(mask), logits_indices=move(qstart[1:] - 1),
            max_query_len=qmax, max_seq_len=lmax,
        )
