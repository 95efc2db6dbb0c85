"""Attention metadata for one forward over a ragged batch.

The model sees a flat list of ``T`` new tokens from ``S`` sequences. For sequence
``s`` the metadata says how many new tokens it brings (``query_lens[s]``), how many
tokens its queries attend to once those are written (``seq_lens[s]``: cached
context plus the new tokens) and where each new token's K/V goes in the cache
(``slot_mapping``, a flat slot index = block * block_size + offset). With that, one
forward serves a prefill, a decode step, a prefill chunk or any mix of them.

Attention itself pads sequences to a common query and context length. To keep
that padding small, sequences are split into *groups*: decode sequences (one
query each) are padded only among themselves, and multi-token sequences
(prefills, chunks) among themselves; a decode token is never padded to the
length of a prompt. Everything here is computed once per step and shared by all
layers, so the layers only gather, multiply and scatter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


@dataclass
class AttentionMetadata:
    query_lens: torch.Tensor        # [S] new tokens per sequence
    seq_lens: torch.Tensor          # [S] context length after this step's tokens
    query_start_loc: torch.Tensor   # [S+1] offsets of each sequence in the flat batch
    slot_mapping: torch.Tensor | None   # [T] cache slot of each new token (None: no cache)
    block_tables: torch.Tensor | None   # [S, max_blocks] physical block ids
    block_size: int
    groups: list[AttentionGroup]    # decode sequences and multi-token sequences, padded apart
    logits_indices: torch.Tensor    # [S] the last new token of each sequence
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return int(self.query_lens.numel())

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
        ql = torch.tensor(list(query_lens), dtype=torch.long)
        sl = torch.tensor(list(seq_lens), dtype=torch.long)
        qstart = torch.zeros(S + 1, dtype=torch.long)
        qstart[1:] = torch.cumsum(ql, 0)

        if block_tables is None:
            if any(q != n for q, n in zip(query_lens, seq_lens)):
                raise ValueError("without a cache every sequence attends only to its new tokens")
            bt = None
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

        decode = [s for s in range(S) if query_lens[s] == 1]
        multi = [s for s in range(S) if query_lens[s] > 1]
        parts = [g for g in (decode, multi) if g]
        groups, slot_parts = [], []
        for seqs in parts:
            group, slots = _build_group(seqs, ql, sl, qstart, bt, block_size, whole=len(parts) == 1)
            groups.append(group)
            slot_parts.append((group.token_index, slots))
        slot_mapping = None
        if bt is not None:
            slot_mapping = torch.empty(int(qstart[-1]), dtype=torch.long)
            for tok, slots in slot_parts:
                if tok is None:
                    slot_mapping = slots
                else:
                    slot_mapping[tok] = slots

        dev = torch.device(device)
        move = lambda t: None if t is None else t.to(dev, non_blocking=True)  # noqa: E731
        for g in groups:
            g.token_index, g.query_index = move(g.token_index), move(g.query_index)
            g.context_index, g.mask = move(g.context_index), move(g.mask)
        return cls(
            query_lens=move(ql), seq_lens=move(sl), query_start_loc=move(qstart),
            slot_mapping=move(slot_mapping), block_tables=move(bt), block_size=block_size,
            groups=groups, logits_indices=move(qstart[1:] - 1),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        )


def _build_group(seqs, ql_all, sl_all, qstart_all, bt, block_size, whole):
    """Padded layout of the sequences ``seqs``; returns the group and the cache slot
    of each of its tokens (None without a cache)."""
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
        slots = None
    else:
        table = bt[idx]
        blk = (key_pos // block_size).clamp(max=table.shape[1] - 1)
        context_index = table[:, blk] * block_size + (key_pos % block_size)[None, :]
        slots = context_index[seq_of_token, (sl - ql)[seq_of_token] + offset_in_seq]
    return AttentionGroup(None if whole else token_index, query_index, context_index, mask,
                          S, qmax, lmax), slots
