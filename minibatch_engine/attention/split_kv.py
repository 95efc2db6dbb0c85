"""FlashDecoding's split-KV, in plain torch: cut a context into chunks, attend
to each alone, then merge the partial results exactly.

A paged decode kernel runs one program per (sequence, KV head). At batch 1 a
model with 8 KV heads has 8 programs, and a GPU with 132 streaming
multiprocessors (an H100) leaves most of them idle while 8 read a long
context one tile after another. Flash-Decoding (Dao, Haziza, Massa and
Sizov, 2023) adds parallelism along the keys instead: each chunk of
``split_size`` key positions gets a program of its own, which returns its
chunk's attention output ``o_j`` (normalised within the chunk) and the
chunk's log-sum-exp ``lse_j = log sum_k exp(s_k)``. A second, small kernel
merges the chunks:

    lse = log sum_j exp(lse_j),    out = sum_j exp(lse_j - lse) * o_j

This is exact, not an approximation: it is the online softmax's rescaling,
applied once across chunks instead of tile by tile. A chunk that holds no key
a query may see (past the context, or after the query under the causal mask)
has ``lse_j = -inf`` and weight 0.

:func:`split_kv_attention` is the reference over a ragged batch on the paged
cache (the Triton version is :mod:`.triton_split_kv`); :func:`plan_kv_splits`
is the rule a backend uses to decide whether, and how finely, to split.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

H100_SMS = 132   # streaming multiprocessors of an H100 SXM (and an H200): the default target


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [Q, H, D]`` to one chunk of keys ``k, v [N, H, D]`` under
    ``mask [Q, N]`` (True: visible). Returns the chunk's output ``[Q, H, D]``
    (zero where a row sees no key) and its log-sum-exp ``[Q, H]`` (``-inf`` there)."""
    scores = torch.einsum("qhd,nhd->hqn", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                              # [H, Q]
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, 0.0)[..., None])  # 0 where masked
    out = torch.einsum("hqn,nhd->qhd", probs, v)
    return out, lse.transpose(0, 1)


def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> torch.Tensor:
    """Merge chunk outputs ``[Q, H, D]`` by their log-sum-exps ``[Q, H]``:
    ``sum_j exp(lse_j - lse) * o_j``. Every row must see a key in some chunk."""
    lse = torch.stack(list(lses))                                      # [J, Q, H]
    total = torch.logsumexp(lse, dim=0)
    weights = torch.exp(lse - total)                                   # 0 for -inf chunks
    return (weights[..., None] * torch.stack(list(outs))).sum(0)


def split_kv_attention(q: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor,
                       query_lens: Sequence[int], seq_lens: Sequence[int],
                       block_tables: Sequence[Sequence[int]] | None, block_size: int,
                       split_size: int) -> torch.Tensor:
    """Causal attention over a ragged batch, each context cut into chunks of
    ``split_size`` key positions and merged (the reference for the split kernel).

    ``q [T, Hq, D]``: the batch's new tokens; ``k_src, v_src [slots, Hkv, D]``:
    the paged pool with this step's K/V already written (or, with
    ``block_tables=None``, the step's own K/V, each sequence attending only to
    its new tokens). Grouped-query attention: ``Hq`` a multiple of ``Hkv``.
    """
    if split_size <= 0:
        raise ValueError(f"split_size must be positive, got {split_size}")
    T, Hq, D = q.shape
    G = Hq // k_src.shape[1]
    out = torch.empty_like(q)
    start = 0
    for s, (ql, n) in enumerate(zip(query_lens, seq_lens)):
        if block_tables is None:
            slots = torch.arange(start, start + n)
        else:
            pos = torch.arange(n)
            table = torch.as_tensor(list(block_tables[s]), dtype=torch.long)
            slots = table[pos // block_size] * block_size + pos % block_size
        keys = k_src[slots].repeat_interleave(G, dim=1)                # [n, Hq, D]
        values = v_src[slots].repeat_interleave(G, dim=1)
        q_pos = torch.arange(n - ql, n)                                # each query's position
        rows = q[start:start + ql]
        outs, lses = [], []
        for lo in range(0, n, split_size):
            hi = min(lo + split_size, n)
            mask = torch.arange(lo, hi)[None, :] <= q_pos[:, None]     # causal, within the chunk
            o, lse = partial_attention(rows, keys[lo:hi], values[lo:hi], mask)
            outs.append(o), lses.append(lse)
        out[start:start + ql] = merge_partials(outs, lses)
        start += ql
    return out


def plan_kv_splits(num_programs: int, max_seq_len: int, num_sms: int = H100_SMS,
                   block_n: int = 64, min_split: int = 256) -> tuple[int, int]:
    """``(num_splits, split_size)`` for a step whose unsplit kernel would run
    ``num_programs`` programs (sequences x KV heads x query tiles).

    Programs run in waves of ``num_sms``. Split only when the programs fill
    less than 80% of one wave and the longest context holds at least two
    chunks of ``min_split`` keys (a shorter chunk saves less than the merge
    costs). Then, of the chunk counts ``s`` that leave chunks that long, take
    the smallest whose waves are at least 85% as full, on average, as the
    fullest any ``s`` achieves (``num_programs * s / (waves * num_sms)``):
    more chunks mean more merge work. Chunks are a whole number of the kernel's
    ``block_n``-key tiles. ``(1, max_seq_len)`` means "do not split".
    """
    if num_programs <= 0 or max_seq_len <= 0:
        raise ValueError(f"num_programs ({num_programs}) and max_seq_len ({max_seq_len}) must be positive")
    most = max_seq_len // min_split
    if num_programs >= 0.8 * num_sms or most < 2:
        return 1, max_seq_len
    fill = [num_programs * s / (-(-num_programs * s // num_sms) * num_sms) for s in range(1, most + 1)]
    splits = next(s for s, f in enumerate(fill, start=1) if f >= 0.85 * max(fill))
    if splits == 1:
        return 1, max_seq_len
    size = -(-max_seq_len // splits)
    size = -(-size // block_n) * block_n                               # whole tiles
    return -(-max_seq_len // size), size


__all__ = ["H100_SMS", "partial_attention", "merge_partials", "split_kv_attention", "plan_kv_splits"]
