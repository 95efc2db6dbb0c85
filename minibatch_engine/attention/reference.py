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

import torch

from .backend import AttentionBackend
from .metadata import AttentionGroup, AttentionMetadata


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     meta: AttentionMetadata,
                     k_cache: torch.Tensor | None = None,
                     v_cache: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for ``T`` flat tokens.

    q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (this step's new tokens).
    k_cache, v_cache: ``[num_slots, Hkv, D]`` views of one layer's pool, or None
    for a cache-free forward. New K/V are written at ``meta.slot_mapping`` first,
    then each sequence reads its whole context through its group's
    ``context_index``. Returns ``[T, Hq, D]``.
    """
    return REFERENCE.forward(q, k, v, meta, k_cache, v_cache)


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
    keys, values = k_src[g.context_index], v_src[g.context_index]      # [S, Lmax, Hkv, D]
    qp = q.new_zeros(S * Qmax, Hq, D)
    qp[g.query_index] = q
    qp = qp.view(S, Qmax, Hkv, G, D)
    scores = torch.einsum("sqhgd,slhd->shgql", qp, keys) / math.sqrt(D)
    scores = scores.masked_fill(~g.mask[:, None, None], float("-inf"))
    low_precision = q.dtype in (torch.float16, torch.bfloat16)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if low_precision else q.dtype).to(q.dtype)
    out = torch.einsum("shgql,slhd->sqhgd", probs, values).reshape(S * Qmax, Hq, D)
    return out[g.query_index]
