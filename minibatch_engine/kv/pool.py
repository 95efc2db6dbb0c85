"""The physical KV memory: one preallocated pool of blocks per layer.

A block holds ``block_size`` consecutive tokens of one sequence. A slot is one
token's place: ``slot = block_id * block_size + offset``. The model runner owns
the pool (the forward writes it; :meth:`KVPool.copy_blocks` carries out
copy-on-write); the scheduler's cache managers only decide which blocks each
request owns, and differ in how they hand them out:

* :class:`~minibatch_engine.kv.reserved.ReservedKVCache`: one block of ``max_model_len``
  tokens per request, taken at admission (Orca, static batching);
* the paged cache (chapter 4): small blocks taken as a sequence grows.

The last block of the pool is a *null block* that belongs to no request: padding
work (the static batcher's pad tokens) writes its K/V there.

With ``kv_cache_dtype="fp8"`` or ``"int8"`` the pool stores K and V in one byte
each with float32 scales beside them (:mod:`.quant`): per (token, KV head) in
``scales``, shaped like the pool without its head dimension, so every block
copy and swap moves a block's scales with its bytes; or static scales per head
(``kv_cache_scale="per_head"`` / ``"per_tensor"``, calibrated and passed as
``static_scales``), which never move.
"""
from __future__ import annotations

import mmap
import sys

import torch

from .quant import SCALE_GRANULARITIES, QuantizedSlots, kv_format

_MIN_MMAP_BYTES = 8 << 20


def _lazy_zeros(shape, dtype) -> torch.Tensor:
    """A zero CPU tensor in fresh anonymous memory (``mmap``).

    Anonymous memory is zero by definition, and the OS materialises its pages
    only when they are first written: a pool of hundreds of MiB costs nothing
    until its blocks are used, where ``torch.zeros`` would write every byte up
    front (tens of ms for the default pool, paid by every engine that is
    built). Small pools, other systems, or any failure: ``torch.zeros``.
    """
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < _MIN_MMAP_BYTES:
        return torch.zeros(shape, dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # zero-filled
        return torch.frombuffer(buf, dtype=dtype).view(shape)   # shares buf's memory, keeps it alive
    except (OSError, ValueError, AttributeError):
        return torch.zeros(shape, dtype=dtype)


class KVPool:
    @classmethod
    def for_cache(cls, kv_cache, model_config, dtype: torch.dtype, device: torch.device | str,
                  kv_cache_dtype: str = "auto") -> "KVPool":
        """The pool a cache manager (paged or reserved) hands out: its blocks, in
        the model's shape."""
        return cls(model_config.num_layers, kv_cache.num_blocks, kv_cache.block_size,
                   model_config.num_kv_heads, model_config.head_dim, dtype, device, kv_cache_dtype)

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 kv_cache_dtype: str = "auto", kv_cache_scale: str = "per_token_head",
                 static_scales: torch.Tensor | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.kv_cache_dtype, self.kv_cache_scale = kv_cache_dtype, kv_cache_scale
        self.format = kv_format(kv_cache_dtype)
        storage = dtype if self.format is None else self.format.storage
        # [layers, K/V, num_blocks + 1 (null block), block_size, kv_heads, head_dim]
        shape = (num_layers, 2, num_blocks + 1, block_size, num_kv_heads, head_dim)
        cpu = torch.device(device).type == "cpu"
        self.kv = _lazy_zeros(shape, storage) if cpu else torch.zeros(shape, dtype=storage, device=device)
        self.scales = self._make_scales(shape[:-1], static_scales, cpu, device)
        self.null_block = num_blocks

    def _make_scales(self, shape, static_scales, cpu, device) -> torch.Tensor | None:
        """Per-(token, head) scales ``[layers, 2, blocks + 1, block_size, kv_heads]``
        (float32, written with the data), the static ``[layers, 2, kv_heads]`` given, or None (no format)."""
        if self.kv_cache_scale not in SCALE_GRANULARITIES:
            raise ValueError(f"kv_cache_scale must be one of {', '.join(SCALE_GRANULARITIES)}, "
                             f"got {self.kv_cache_scale!r}")
        if self.format is None:
            return None
        if self.kv_cache_scale == "per_token_head":
            if static_scales is not None:
                raise ValueError("static_scales are for kv_cache_scale='per_head' or 'per_tensor'")
            return (_lazy_zeros(shape, torch.float32) if cpu
                    else torch.zeros(shape, dtype=torch.float32, device=device))
        want = (self.num_layers, 2, self.num_kv_heads)
        if static_scales is None or tuple(static_scales.shape) != want:
            raise ValueError(f"kv_cache_scale={self.kv_cache_scale!r} needs static_scales of shape {want} "
                             "(calibrate them: minibatch_engine.model.kv_quant_accuracy.calibrate_kv_scales)")
        return static_scales.to(device=device, dtype=torch.float32).contiguous()

    @property
    def quantized(self) -> bool:
        return self.format is not None

    def layer(self, i: int):
        """(k_slots, v_slots) of layer ``i``, each ``[num_slots, kv_heads, head_dim]``;
        for a quantized pool each is a :class:`~.quant.QuantizedSlots` (bytes and scales)."""
        flat = self.kv[i].view(2, -1, self.num_kv_heads, self.head_dim)
        if self.format is None:
            return flat[0], flat[1]
        scales = self.scales[i]
        if self.kv_cache_scale == "per_token_head":
            scales = scales.view(2, -1, self.num_kv_heads)
        return QuantizedSlots(flat[0], scales[0], self.format), QuantizedSlots(flat[1], scales[1], self.format)

    def block_tensors(self) -> list[torch.Tensor]:
        """The tensors indexed by block in dim 2 that a block copy or swap moves:
        the K/V bytes, and per-(token, head) scales when there are any."""
        per_token_scales = self.scales is not None and self.kv_cache_scale == "per_token_head"
        return [self.kv, self.scales] if per_token_scales else [self.kv]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src[i]`` into ``dst[i]``, every layer, K and V (and their scales)."""
        if src:
            dev = self.kv.device
            s, d = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
            for t in self.block_tensors():
                t[:, :, d] = t[:, :, s]

    @property
    def bytes_per_token(self) -> int:
        """2 x layers x kv_heads x (head_dim x bytes per element, plus 4 bytes of
        scale per head when each token has its own)."""
        per_head = self.head_dim * self.kv.element_size()
        if self.scales is not None and self.kv_cache_scale == "per_token_head":
            per_head += self.scales.element_size()
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def allocated_bytes(self) -> int:
        """Bytes the pool's tensor really holds (usable blocks only, not the null block)."""
        return self.bytes_per_block * self.num_blocks


def carry_out(copies, pool: KVPool, host=None) -> None:
    """Carry out a step's block copies (:class:`~minibatch_engine.core.outputs.BlockCopy`)
    in the scheduler's order: ``"copy"`` within ``pool``, ``"swap_out"`` and
    ``"swap_in"`` between ``pool`` and the host pool ``host``. Each run of copies
    of one kind is one batched copy (a run ends early where a copy would read a
    block the run writes)."""
    i = 0
    while i < len(copies):
        kind, src, dst = copies[i].kind, [], []
        while i < len(copies) and copies[i].kind == kind and copies[i].src not in dst:
            src.append(copies[i].src)
            dst.append(copies[i].dst)
            i += 1
        if kind == "copy":
            pool.copy_blocks(src, dst)
        elif host is None:
            raise RuntimeError(f"a {kind} needs a host pool, and none was given")
        elif kind == "swap_out":
            host.swap_out(pool, src, dst)
        else:
            host.swap_in(pool, src, dst)
