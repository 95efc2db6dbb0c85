"""Reference attention over a ragged batch, in plain torch.

One function serves every case the engine produces: a sequence's new queries
attend to its cached context plus, causally, to each other. The cache is one
flat pool of slots per layer (``[num_slots, kv_heads, head_dim]``); a slot cache
and a paged cache differ only in how the metadata's ``context_index`` was built
from their block tables. Sequences are padded *inside attention only*, within
their group (decodes with decodes, prefills with prefills); all other layers
see the flat tokens. :class:`ReferenceBackend` is this function behind the
backend interface: every faster backend is tested against it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..kv.quant import read_slots
from .backend import AttentionBackend
from .metadata import BatchMetadata, batch_fields, to_device


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
class AttentionMetadata(BatchMetadata):
    """The reference backend's metadata: the batch plus padded groups."""
    groups: list[AttentionGroup]    # decode sequences and multi-token sequences, padded apart

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]] | None = None,
              block_size: int = 0, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Build the metadata for a batch (see :func:`batch_fields` for the
        arguments). Decode sequences and multi-token sequences are padded apart."""
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



class ReferenceBackend(AttentionBackend):
    """Gather each sequence's whole context into a padded tensor, two einsums."""

    name = "reference"

    def build_metadata(self, query_lens, seq_lens, block_tables=None, block_size=0, device="cpu"):
        return AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, device)

    def attend(self, q, k, v, meta: AttentionMetadata, k_cache, v_cache):
        return _ragged(q, *((k_cache, v_cache) if k_cache is not None else (k, v)), meta)


REFERENCE = ReferenceBackend()


def _ragged(q, k_src, v_src, meta: AttentionMetadata) -> torch.Tensor:
    if len(meta.groups) == 1 and meta.groups[0].token_index is None:
        return _group_attention(q, k_src, v_src, meta.groups[0])
    out = torch.empty_like(q)
    for g in meta.groups:
        out[g.token_index] = _group_attention(q[g.token_index], k_src, v_src, g)
    return out


def _group_attention(q, k_src, v_src, g: AttentionGroup) -> torch.Tensor:
    Tg, Hq, D = q.shape
    Hkv = k_src.shape[1]
    G = Hq // Hkv
    S, Qmax = g.num_seqs, g.max_query_len
    keys = read_slots(k_src, g.context_index, q.dtype)               # [S, Lmax, Hkv, D]
    values = read_slots(v_src, g.context_index, q.dtype)             # (dequantized if stored in 8 bits)
    qp = q.new_zeros(S * Qmax, Hq, D)
    qp[g.query_index] = q
    qp = qp.view(S, Qmax, Hkv, G, D)
    scores = torch.einsum("sqhgd,slhd->shgql", qp, keys) / math.sqrt(D)
    scores = scores.masked_fill(~g.mask[:, None, None], float("-inf"))
    low_precision = q.dtype in (torch.float16, torch.bfloat16)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if low_precision else q.dtype).to(q.dtype)
    out = torch.einsum("shgql,slhd->sqhgd", probs, values).reshape(S * Qmax, Hq, D)
    return out[g.query_index]
