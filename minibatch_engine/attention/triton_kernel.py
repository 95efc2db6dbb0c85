"""A paged-attention kernel in Triton: K/V read through the block table, in place.

The reference and sdpa backends first *copy* each sequence's context out of the
paged pool. This kernel never does: each program walks its sequence's block
table and loads K/V tiles straight from wherever the blocks lie in the pool
(PagedAttention, Kwon et al., SOSP 2023), keeping a running max, running sum
and output accumulator per query row (online softmax: Milakov & Gimelshein
2018; the tiling of FlashAttention, Dao et al. 2022). The score matrix never
leaves registers.

**One program per (sequence, KV head, tile of query rows).** The rows of a tile
are (query token, query head) pairs: the ``G = Hq / Hkv`` query heads that share
a KV head are stacked, so each K/V tile loaded from the pool serves all of them
(grouped-query attention reads K/V once per group, not once per query head).
A decode step has ``G`` rows per program; a prefill chunk of ``Q`` tokens has
``Q * G`` rows, cut into tiles of ``BLOCK_M``. Rows are padded up to
``BLOCK_M >= 16`` because ``tl.dot`` needs it; decode is bound by the bytes of
K/V it reads, so the padded rows cost arithmetic, not memory traffic.

**Keys in tiles of ``BLOCK_N`` token positions, independent of the block size.**
Position ``p`` of a sequence lives in slot ``block_table[p // block_size] *
block_size + p % block_size``, so the same loop works for block sizes 1, 16 or
32, and for the cache-free case (``PAGED=False``: keys are the step's own
tokens, slot = the sequence's start in the flat batch + ``p``). The loop stops
at the last key the tile's last query may see: causal masking skips whole
tiles, and inside the last ones ``key <= query position`` masks the rest.

Accumulators are float32 (float64 for float64 inputs, so the float64 checks
stay exact); fp32 products use ``input_precision="ieee"`` (no TF32).
A quantized cache (``KV_QUANT``: 1 int8, 2 float8 e4m3, passed as its bytes)
is read through :func:`load_kv_tile`, which dequantizes each tile as it loads
it (stored value x the slot's float32 scale per KV head) in the accumulator's
dtype and hands the dot product the query's dtype.
Not done: splitting a long context over several programs (flash-decoding),
which a GPU wants when there are fewer (sequence, KV head) pairs than cores.
"""
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(ptr, scale_ptr, slot, kv_head, stride_t, stride_h, stride_s, d, mask,
                 KV_QUANT: tl.constexpr, ACC_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_D]`` tile of K or V at ``slot``: as stored, or (``KV_QUANT``
    1: int8, 2: float8 e4m3 bytes) dequantized with the slot's scale for ``kv_head``."""
    x = tl.load(ptr + slot[:, None] * stride_t + kv_head * stride_h + d[None, :], mask=mask, other=0)
    if KV_QUANT == 0:
        return x
    if KV_QUANT == 2:
        x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)    # exact: e4m3 fits float32
    s = tl.load(scale_ptr + slot * stride_s + kv_head)
    return (x.to(ACC_DTYPE) * s.to(ACC_DTYPE)[:, None]).to(OUT_DTYPE)


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    block_tables_ptr, seq_lens_ptr, query_lens_ptr, query_start_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
    k_scale_ptr, v_scale_ptr, stride_ks, stride_vs, KV_QUANT: tl.constexpr,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(query_start_ptr + seq)
    if tile * BLOCK_M >= q_len * G:        # this sequence has fewer query rows
        return

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G                          # query token of each row
    head = kv_head * G + rows % G           # query head of each row
    row_ok = qi < q_len
    q_pos = seq_len - q_len + qi            # absolute position of each row's query
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    scale = 1.0 / tl.sqrt(tl.full([1], HEAD_DIM, ACC_DTYPE))

    m_i = tl.full([BLOCK_M], float("-inf"), ACC_DTYPE)   # running max of each row
    l_i = tl.zeros([BLOCK_M], ACC_DTYPE)                 # running sum of exp(score - max)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_DTYPE)        # running sum of exp(...) * V
    last_q = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // G)
    num_keys = seq_len - q_len + last_q + 1               # keys the tile's last query sees
    for start in range(0, num_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < num_keys
        if PAGED:
            block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
            slot = block * BLOCK_SIZE + n % BLOCK_SIZE
        else:
            slot = q_start + n
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = load_kv_tile(k_ptr, k_scale_ptr, slot, kv_head, stride_kt, stride_kh, stride_ks, d, kv_mask,
                         KV_QUANT, ACC_DTYPE, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(ACC_DTYPE) * scale
        # Key 0 is in the first tile and every row may see it, so m_new is finite.
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)                       # rescales what was summed so far
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(v_ptr, v_scale_ptr, slot, kv_head, stride_vt, stride_vh, stride_vs, d, kv_mask,
                         KV_QUANT, ACC_DTYPE, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(ACC_DTYPE)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
