"""The fast CPU path: gather whole blocks, bucket decodes by length, call SDPA.

On a CPU, attention over a paged cache is memory-bound: a decode reads every
cached K and V of its sequence once and does only ~4 flops per byte. The
reference backend spends its time moving memory it does not need: it pads every
sequence to the longest one, gathers the padded context token by token, and
then reads the copy twice in two einsums. This backend keeps the same
arithmetic and cuts the traffic (measured in ``benchmarks/attention_backends.py``):

* **Block gathers.** ``k_cache.view(num_blocks, block_size, Hkv, D)[table]``
  copies whole blocks (``block_size * Hkv * D`` contiguous values) instead of
  single tokens; the block table is all the index it needs (PagedAttention,
  Kwon et al., SOSP 2023).
* **Length buckets for decodes.** Decode sequences are sorted by their number
  of blocks and cut into buckets whose padding stays under ``max_waste`` of the
  bucket's work, so a 16-token context is not padded to 384. Each bucket is one
  ``torch.nn.functional.scaled_dot_product_attention`` call: the query heads
  sharing a KV head are stacked as that head's query rows (grouped-query
  attention without copying K/V), and an additive mask hides the unused tail of
  each sequence's last block. SDPA's CPU kernel is a fused flash-style loop
  with an online softmax (Milakov & Gimelshein 2018; Dao et al. 2022): it reads
  the gathered K and V once and never materialises the score matrix.
* **Prefills and chunks one sequence at a time.** A sequence with several new
  tokens is compute-heavy enough to amortise its own call. With no cached
  context its keys are exactly this step's new K/V, read from the flat batch
  with ``is_causal=True`` (no gather at all); a chunk that continues a cached
  prefix gathers its blocks and uses a causal mask offset by the cached length.

The bucketing, the masks and the per-sequence plans are computed once per step
in :meth:`SdpaBackend.build_metadata`; the layers only gather and call SDPA.

Large blocks are read in smaller pieces: a reserved cache's block is a whole
``max_model_len`` row, and gathering it whole would copy every empty slot of
the row. Since a block's slots are contiguous, a block of ``B`` slots is also
``B / b`` blocks of ``b`` slots (``b = gcd(B, max_gather_block)``), and the
block table is rewritten at that granularity before planning.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import math

import torch
import torch.nn.functional as F

from ..kv.quant import is_quantized, read_blocks, read_slots
from .backend import AttentionBackend
from .metadata import BatchMetadata, batch_fields, to_device


@dataclass
class DecodeBucket:
    """Decode sequences padded to ``num_blocks`` blocks together."""
    token_index: torch.Tensor     # [n] each sequence's (single) token in the flat batch
    block_table: torch.Tensor     # [n, num_blocks]
    valid: torch.Tensor           # [n, num_blocks * block_size] True where the key exists
    num_blocks: int


@dataclass
class MultiTokenPlan:
    """One sequence with several new tokens (or any sequence without a cache)."""
    start: int                    # its tokens are q[start:end] in the flat batch
    end: int
    context_len: int              # cached tokens before this step's (0: fresh prefill)
    block_table: torch.Tensor | None   # [blocks] when context_len > 0
    valid: torch.Tensor | None    # [Q, L] causal mask offset by context_len (None: plain causal)


@dataclass(kw_only=True)
class SdpaMetadata(BatchMetadata):
    decode_buckets: list[DecodeBucket]
    multi_token: list[MultiTokenPlan]
    _masks: dict = field(default_factory=dict, repr=False)   # additive masks per dtype, made once per step

    def additive_mask(self, key, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``valid`` as 0 / -inf in ``dtype``, converted at the first layer and reused."""
        if (key, dtype) not in self._masks:
            self._masks[key, dtype] = torch.zeros(valid.shape, dtype=dtype, device=valid.device) \
                .masked_fill_(~valid, float("-inf"))
        return self._masks[key, dtype]


def length_buckets(num_blocks: list[int], max_waste: float) -> list[list[int]]:
    """Indices sorted by ``num_blocks`` (longest first), cut greedily so that every
    bucket's padded size (members x its longest) wastes at most ``max_waste`` of it."""
    order = sorted(range(len(num_blocks)), key=lambda i: -num_blocks[i])
    buckets: list[list[int]] = []
    used = 0
    for i in order:
        if buckets:
            cur = buckets[-1]
            padded = (len(cur) + 1) * num_blocks[cur[0]]
            if padded - (used + num_blocks[i]) <= max_waste * padded:
                cur.append(i)
                used += num_blocks[i]
                continue
        buckets.append([i])
        used = num_blocks[i]
    return buckets


class SdpaBackend(AttentionBackend):
    """Block gathers + length-bucketed ``scaled_dot_product_attention`` (see the module)."""

    name = "sdpa"

    def __init__(self, max_waste: float = 0.125, max_gather_block: int = 64):
        if not 0 <= max_waste < 1:
            raise ValueError(f"max_waste must be in [0, 1), got {max_waste}")
        if max_gather_block < 1:
            raise ValueError(f"max_gather_block must be >= 1, got {max_gather_block}")
        self.max_waste, self.max_gather_block = max_waste, max_gather_block

    def build_metadata(self, query_lens, seq_lens, block_tables=None, block_size=0, device="cpu"):
        fields = batch_fields(query_lens, seq_lens, block_tables, block_size)
        if fields["block_tables"] is not None and block_size > self.max_gather_block:
            # read big blocks (reserved rows) in pieces of `sub` slots: same slots, finer table
            sub = math.gcd(block_size, self.max_gather_block)
            r = block_size // sub
            bt = fields["block_tables"]
            fields["block_tables"] = (bt[:, :, None] * r + torch.arange(r)).reshape(bt.shape[0], -1)
            fields["block_size"] = block_size = sub
        qstart, bt = fields["query_start_loc"].tolist(), fields["block_tables"]
        dev = torch.device(device)
        decode = [s for s, q in enumerate(query_lens) if q == 1] if bt is not None else []
        buckets = []
        if decode:
            nblocks = [-(-seq_lens[s] // block_size) for s in decode]
            for members in length_buckets(nblocks, self.max_waste):
                seqs = [decode[i] for i in members]
                width = nblocks[members[0]]
                idx = torch.tensor(seqs)
                lens = fields["seq_lens"][idx]
                valid = torch.arange(width * block_size)[None, :] < lens[:, None]
                buckets.append(DecodeBucket(fields["query_start_loc"][idx].to(dev),
                                            bt[idx, :width].to(dev), valid.to(dev), width))
        multi = []
        for s in range(len(query_lens)):
            if bt is not None and query_lens[s] == 1:
                continue
            Q, L = query_lens[s], seq_lens[s]
            table = valid = None
            if L > Q:   # a chunk after cached context: read the context through the table
                table = bt[s, :-(-L // block_size)].to(dev)
                valid = (torch.arange(L)[None, :] <= (L - Q + torch.arange(Q))[:, None]).to(dev)
            multi.append(MultiTokenPlan(qstart[s], qstart[s + 1], L - Q, table, valid))
        return SdpaMetadata(**to_device(fields, dev), decode_buckets=buckets, multi_token=multi,
                            backend=self)

    def attend(self, q, k, v, meta: SdpaMetadata, k_cache, v_cache):
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        if len(meta.multi_token) == 1 and not meta.decode_buckets:
            return self._multi_token(q, k, v, meta, meta.multi_token[0], k_cache, v_cache, 0)
        out = torch.empty_like(q)
        if meta.decode_buckets:
            bs = meta.block_size
            for b, bucket in enumerate(meta.decode_buckets):
                n, width = bucket.token_index.numel(), bucket.num_blocks * bs
                keys = read_blocks(k_cache, bs, bucket.block_table, q.dtype).view(n, width, Hkv, D).transpose(1, 2)
                values = read_blocks(v_cache, bs, bucket.block_table, q.dtype).view(n, width, Hkv, D).transpose(1, 2)
                queries = q[bucket.token_index].view(n, Hkv, Hq // Hkv, D)  # GQA: heads as rows
                mask = meta.additive_mask(("decode", b), bucket.valid, q.dtype)[:, None, None, :]
                out[bucket.token_index] = F.scaled_dot_product_attention(
                    queries, keys, values, attn_mask=mask).reshape(n, Hq, D)
        for i, plan in enumerate(meta.multi_token):
            out[plan.start:plan.end] = self._multi_token(q, k, v, meta, plan, k_cache, v_cache, i)
        return out

    @staticmethod
    def _multi_token(q, k, v, meta, plan: MultiTokenPlan, k_cache, v_cache, i):
        queries = q[plan.start:plan.end].transpose(0, 1)                  # [Hq, Q, D]
        if plan.context_len == 0:    # keys are this step's own tokens (as stored, if quantized)
            keys, values = k[plan.start:plan.end], v[plan.start:plan.end]
            if is_quantized(k_cache):
                slots = meta.slot_mapping[plan.start:plan.end]
                keys, values = read_slots(k_cache, slots, q.dtype), read_slots(v_cache, slots, q.dtype)
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                                 enable_gqa=True)
        else:
            Hkv, D = k.shape[1:]
            L = plan.context_len + plan.end - plan.start
            keys = read_blocks(k_cache, meta.block_size, plan.block_table, q.dtype).view(-1, Hkv, D)[:L]
            values = read_blocks(v_cache, meta.block_size, plan.block_table, q.dtype).view(-1, Hkv, D)[:L]
            mask = meta.additive_mask(("multi", i), plan.valid, q.dtype)
            out = F.scaled_dot_product_attention(queries, keys.transpose(0, 1), values.transpose(0, 1),
                                                 attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)
