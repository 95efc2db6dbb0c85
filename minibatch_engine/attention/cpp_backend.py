"""The ``"cpp"`` backend: the C++ paged-attention kernel for the CPU.

Like the Triton backend, its metadata is only the batch (lengths, offsets, block
tables): the kernel (:mod:`.cpu_kernel`, source in ``csrc/``) reads K/V through
the block table where they lie in the pool, so nothing is gathered, padded or
bucketed on the host. It is the fastest CPU path measured here (chapter 10;
``benchmarks/attention_backends.py``) and what ``"auto"`` picks on a CPU when
the kernel builds; without a C++ compiler ``"auto"`` falls back to ``"sdpa"``.

A quantized cache (``kv_cache_dtype`` fp8 or int8) is written by the shared
quantizer first (:func:`~minibatch_engine.kv.quant.write_slots`), then read by
the kernel's ``paged_attention_quantized``, which dequantizes each K and V row
as it reads it (plain loops: the explicit-SIMD passes read float caches only).
"""
from __future__ import annotations

import torch

from ..kv.quant import is_quantized
from .backend import AttentionBackend
from .cpu_kernel import load_cpu_kernel
from .metadata import BatchMetadata, batch_fields


class CppBackend(AttentionBackend):
    """One call of the C++ kernel per layer for the whole ragged batch.

    ``simd=False`` runs the kernel's plain loops even where its explicit-SIMD
    passes apply (float32/float64, head size 64 or 128): the same results up to
    float rounding, slower; chapter 10 measures the two side by side."""

    name = "cpp"
    writes_kv = True   # the kernel stores the step's K/V in their slots, then attends

    def __init__(self, simd: bool = True):
        self.kernel = load_cpu_kernel()   # raises KernelUnavailable, saying why
        self.simd = bool(simd)

    def build_metadata(self, query_lens, seq_lens, block_tables=None, block_size=0, device="cpu"):
        if torch.device(device).type != "cpu":
            raise ValueError(f'attention backend "cpp" runs on the CPU, not {torch.device(device).type}')
        return BatchMetadata(**batch_fields(query_lens, seq_lens, block_tables, block_size), backend=self)

    def attend(self, q, k, v, meta: BatchMetadata, k_cache, v_cache):
        if is_quantized(k_cache):   # written already (quantized on write); dequantized in the kernel
            q = q if q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] else q.contiguous()
            return self.kernel.paged_attention_quantized(
                q, k_cache.data, v_cache.data, k_cache.slot_scales(), v_cache.slot_scales(),
                meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.block_size)
        q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()
                   for t in (q, k, v))
        if k_cache is None:   # no cache: the keys are the step's own tokens
            k_cache = v_cache = slot_mapping = block_tables = _EMPTY
        else:
            slot_mapping, block_tables = meta.slot_mapping, meta.block_tables
        return self.kernel.paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables,
                                           meta.seq_lens, meta.query_start_loc, meta.block_size, self.simd)


_EMPTY = torch.empty(0, dtype=torch.long)
