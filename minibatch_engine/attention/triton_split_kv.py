"""Split-KV (Flash-Decoding) for the Triton paged-attention kernel: more
programs for a small batch with long contexts.

:mod:`.triton_kernel` runs one program per (sequence, KV head, tile of query
rows), each walking its whole context. At batch 1 that is a handful of
programs on a GPU with over a hundred SMs. Here each program takes one chunk
of ``split_size`` key positions of that walk instead (grid axis 2 is
``query tile * num_splits + chunk``) and writes its rows' chunk output and
log-sum-exp to float32 scratch; a second kernel merges the chunks of each
(token, query head) (see :mod:`.split_kv` for the arithmetic and the torch
reference). The loop body is the paged kernel's: the same block-table
lookup, causal mask and online softmax, with two guards it does not need: a
row may see no key in its chunk (its running max stays ``-inf``), and a chunk
may lie wholly past a sequence's context (the program exits; the scratch's
``-inf`` log-sum-exp gives it weight 0).

Whether to split is :func:`.split_kv.plan_kv_splits`; the backend calls
:func:`split_kv_attend` when it says so.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernel import load_kv_tile


@triton.jit
def split_kv_partial_kernel(
    q_ptr, k_ptr, v_ptr, part_ptr, lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_lens_ptr, query_start_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_bt,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    num_splits, split_size,
    k_scale_ptr, v_scale_ptr, stride_ks, stride_vs, KV_QUANT: tl.constexpr,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_len = tl.load(query_lens_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(query_start_ptr + seq)
    if tile * BLOCK_M >= q_len * G:        # this sequence has fewer query rows
        return
    last_q = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // G)
    num_keys = seq_len - q_len + last_q + 1               # keys the tile's last query sees
    lo = split * split_size
    hi = tl.minimum(lo + split_size, num_keys)
    if lo >= num_keys:                     # the chunk lies past what the tile sees
        return

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    head = kv_head * G + rows % G
    row_ok = qi < q_len
    q_pos = seq_len - q_len + qi
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    scale = 1.0 / tl.sqrt(tl.full([1], HEAD_DIM, ACC_DTYPE))

    m_i = tl.full([BLOCK_M], float("-inf"), ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_DTYPE)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        if PAGED:
            block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
            slot = block * BLOCK_SIZE + n % BLOCK_SIZE
        else:
            slot = q_start + n
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = load_kv_tile(k_ptr, k_scale_ptr, slot, kv_head, stride_kt, stride_kh, stride_ks, d, kv_mask,
                         KV_QUANT, ACC_DTYPE, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(ACC_DTYPE) * scale
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row that has seen no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(v_ptr, v_scale_ptr, slot, kv_head, stride_vt, stride_vh, stride_vs, d, kv_mask,
                         KV_QUANT, ACC_DTYPE, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(ACC_DTYPE)
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tok = q_start + qi
    tl.store(part_ptr + tok[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :],
             out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + tok * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    part_ptr, lse_ptr, o_ptr,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    j = tl.arange(0, BLOCK_S)
    j_ok = j < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(lse_ptr + tok * stride_lt + head * stride_lh + j, mask=j_ok, other=float("-inf"))
    m = tl.max(lse, 0)                     # finite: chunk 0 holds key 0, which every query sees
    w = tl.exp(lse - m)                    # 0 for chunks with no key (their scratch is never read)
    part = tl.load(part_ptr + tok * stride_pt + head * stride_ph + j[:, None] * stride_ps + d[None, :],
                   mask=(j_ok & (lse > float("-inf")))[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(o_ptr + tok * stride_ot + head * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def split_kv_attend(q: torch.Tensor, k_src: torch.Tensor, v_src: torch.Tensor, out: torch.Tensor,
                    meta, *, paged: bool, num_splits: int, split_size: int, block_m: int, block_n: int,
                    acc_dtype, dot_precision: str = "ieee", kv_quant: int = 0,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for the batch ``meta`` into ``out`` through the two kernels:
    chunks of ``split_size`` keys (a multiple of ``block_n``), ``num_splits``
    of them, enough for the longest context the batch may reach. A quantized
    cache (``kv_quant`` 1 int8, 2 float8 bytes, with its per-slot ``k_scale`` and
    ``v_scale``) is read through the paged kernel's :func:`.load_kv_tile`."""
    if split_size % block_n:
        raise ValueError(f"split_size ({split_size}) must be a multiple of block_n ({block_n})")
    T, Hq, D = q.shape
    Hkv = k_src.shape[1]
    G = Hq // Hkv
    scratch = torch.float64 if q.dtype == torch.float64 else torch.float32
    part = torch.empty(T, Hq, num_splits, D, dtype=scratch, device=q.device)
    lse = torch.full((T, Hq, num_splits), float("-inf"), dtype=scratch, device=q.device)
    bt = meta.block_tables if paged else meta.query_start_loc   # unused when not paged
    rows = meta.max_query_len * G
    block_d = max(16, triton.next_power_of_2(D))
    split_kv_partial_kernel[(meta.num_seqs, Hkv, triton.cdiv(rows, block_m) * num_splits)](
        q, k_src, v_src, part, lse, bt, meta.seq_lens, meta.query_lens, meta.query_start_loc,
        q.stride(0), q.stride(1), k_src.stride(0), k_src.stride(1), v_src.stride(0), v_src.stride(1),
        bt.stride(0), part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        num_splits, split_size,
        k_scale if kv_quant else q, v_scale if kv_quant else q,
        k_scale.stride(0) if kv_quant else 0, v_scale.stride(0) if kv_quant else 0, KV_QUANT=kv_quant,
        G=G, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=max(meta.block_size, 1), PAGED=paged, ACC_DTYPE=acc_dtype, DOT_PRECISION=dot_precision,
    )
    merge_splits_kernel[(T, Hq)](
        part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), num_splits,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
    return out
