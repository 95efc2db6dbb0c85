"""One interface for every attention implementation (the choice between them
is :mod:`.registry`'s).

An attention backend does two things. Once per step, on the host,
``build_metadata`` turns the batch's lengths and block tables into whatever
layout its kernel wants (padded groups, length buckets, plain offsets). Then, in
every layer, ``forward`` writes the step's new K/V into the cache at
``slot_mapping`` and attends. The metadata records the backend that built it
(``meta.backend``), so the model calls the matching ``forward`` and never needs
to be told which backend is in use.

Backends: ``"reference"`` (plain torch, padded, the ground truth), ``"sdpa"``
(block gathers and ``scaled_dot_product_attention`` over length buckets: any
device, no compiler), ``"cpp"`` (a C++ paged-attention kernel for the CPU that
reads K/V through the block table in place, compiled on first use),
``"triton"`` (the same idea as a Triton kernel, for CUDA) and ``"auto"``
(triton on CUDA when it is installed; on a CPU, cpp when it builds; otherwise
sdpa).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from ..kv.quant import is_quantized, write_slots
from .metadata import BatchMetadata

class AttentionBackend(ABC):
    """Builds a step's metadata and runs attention over it (see the module docstring)."""

    name: str = ""
    writes_kv: bool = False   # True: attend() writes the new K/V itself (fused with attention)

    @abstractmethod
    def build_metadata(self, query_lens: Sequence[int], seq_lens: Sequence[int],
                       block_tables: Sequence[Sequence[int]] | None = None, block_size: int = 0,
                       device: torch.device | str = "cpu") -> BatchMetadata:
        """The step's metadata, on ``device``. ``block_tables=None``: no cache (each
        sequence attends only to its new tokens, ``seq_lens == query_lens``)."""

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMetadata,
               k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> torch.Tensor:
        """Attention only. The new K/V are already in the cache, unless the backend
        sets ``writes_kv`` and writes them at ``meta.slot_mapping`` itself (a
        quantized cache is always written before). With a quantized cache every
        key and value is read back from it, the step's own too. Returns
        ``[T, Hq, D]``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMetadata,
                k_cache: torch.Tensor | None = None,
                v_cache: torch.Tensor | None = None) -> torch.Tensor:
        """q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]``, this step's new tokens;
        k_cache, v_cache: one layer's slots ``[num_slots, Hkv, D]`` (plain tensors,
        or :class:`~minibatch_engine.kv.quant.QuantizedSlots` for an fp8/int8
        cache), or None for a cache-free forward. Writes the new K/V at
        ``meta.slot_mapping`` (quantizing them here, for every backend, when the
        cache is quantized), then attends. Returns ``[T, Hq, D]``."""
        if meta.backend is not None and type(meta.backend) is not type(self):
            raise ValueError(f"metadata built by the {meta.backend.name!r} backend was passed to "
                             f"{self.name!r}: build it with the backend that runs it")
        if (k_cache is None) != (meta.slot_mapping is None):
            raise ValueError("a KV cache needs metadata built with block tables, and metadata "
                             "built with block tables needs a KV cache")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
        if k_cache is not None and (not self.writes_kv or is_quantized(k_cache)):
            write_slots(k_cache, meta.slot_mapping, k)     # quantized on write when the cache is
            write_slots(v_cache, meta.slot_mapping, v)
        return self.attend(q, k, v, meta, k_cache, v_cache)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
