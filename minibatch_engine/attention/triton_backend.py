"""The ``"triton"`` backend: plain offsets as metadata, the paged kernel as attention.

The kernel (:mod:`.triton_kernel`) reads K/V through the block table itself, so
the metadata is only the batch (lengths, offsets, block tables): nothing is
padded or gathered on the host. Importing this module imports triton; on a CPU
it runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before
triton is imported), which is how the tests check it against the reference.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..kv.quant import is_quantized
from .backend import AttentionBackend
from .metadata import BatchMetadata, batch_fields, to_device
from .triton_kernel import paged_attention_kernel

_ACC = {torch.float64: tl.float64}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonBackend(AttentionBackend):
    """One kernel launch per layer for the whole ragged batch (see the kernel's docstring)."""

    name = "triton"

    def __init__(self, device: torch.device | str = "cuda", block_m: int = 64, block_n: int = 64):
        dev = torch.device(device)
        if dev.type != "cuda" and not interpreting():
            raise ValueError(f'attention backend "triton" runs on CUDA, not {dev.type}; on a CPU '
                             'use "sdpa" (or set TRITON_INTERPRET=1 before importing triton, for tests)')
        for nm, b in (("block_m", block_m), ("block_n", block_n)):
            if b < 16 or b & (b - 1):
                raise ValueError(f"{nm} must be a power of two >= 16 (tl.dot), got {b}")
        self.block_m, self.block_n = block_m, block_n

    def build_metadata(self, query_lens, seq_lens, block_tables=None, block_size=0, device="cpu"):
        fields = batch_fields(query_lens, seq_lens, block_tables, block_size)
        return BatchMetadata(**to_device(fields, device), backend=self)

    def attend(self, q, k, v, meta: BatchMetadata, k_cache, v_cache):
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        paged = k_cache is not None
        k_src, v_src = (k_cache, v_cache) if paged else (k, v)
        quant, k_scale, v_scale = 0, q, q            # (scales unused when not quantized)
        if is_quantized(k_cache):   # its bytes (float8 as uint8) and per-slot scales
            quant = 2 if k_cache.fmt.name == "fp8" else 1
            k_scale, v_scale = k_cache.slot_scales(), v_cache.slot_scales()
            k_src, v_src = k_cache.data.view(torch.uint8) if quant == 2 else k_cache.data, \
                v_cache.data.view(torch.uint8) if quant == 2 else v_cache.data
        if any(t.stride(-1) != 1 for t in (q, k_src, v_src)):
            raise ValueError("triton attention needs q, k and v with a contiguous head dimension")
        rows = meta.max_query_len * G
        block_m = 16 if rows <= 16 else self.block_m
        out = torch.empty_like(q)
        bt = meta.block_tables if paged else meta.query_start_loc   # unused when not paged
        grid = (meta.num_seqs, Hkv, triton.cdiv(rows, block_m))
        paged_attention_kernel[grid](
            q, k_src, v_src, out, bt, meta.seq_lens, meta.query_lens, meta.query_start_loc,
            q.stride(0), q.stride(1), k_src.stride(0), k_src.stride(1), v_src.stride(0), v_src.stride(1),
            out.stride(0), out.stride(1),
            bt.stride(0),
            k_scale, v_scale, k_scale.stride(0), v_scale.stride(0), KV_QUANT=quant,
            G=G, HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)),
            BLOCK_M=block_m, BLOCK_N=self.block_n, BLOCK_SIZE=max(meta.block_size, 1),
            PAGED=paged, ACC_DTYPE=_ACC.get(q.dtype, tl.float32), DOT_PRECISION="ieee",
        )
        return out
