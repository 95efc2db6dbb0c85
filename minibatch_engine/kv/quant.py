"""A quantized KV cache: K and V stored in 8 bits with float32 scales (vLLM's
``kv_cache_dtype``).

Formats: ``"fp8"`` (float8 e4m3, vLLM's ``fp8`` / ``fp8_e4m3``: 4 exponent bits,
3 mantissa bits, largest value 448) and ``"int8"`` (symmetric, -127..127);
``"auto"`` stores the model's own dtype. A value is stored as ``x / scale``
rounded to the format and read back as ``stored * scale``.

**Scales per (token, KV head)** by default: each token's K (and V) row of one
head gets the scale ``max|x| / qmax`` when it is written. It needs no
calibration, a token with an outlier cannot spoil its neighbours, and it is
local: a token's bytes depend on that token alone, so a cache written in chunks,
after a preemption or through a shared prefix holds exactly the bytes a lone
recompute would. It costs one float32 per (token, head) for K and one for V:
``4 / head_dim`` of the 8-bit payload (3% at head_dim 128). The coarser
alternatives, ``"per_head"`` and ``"per_tensor"``, need static scales calibrated
on sample text (:func:`calibrate_kv_scales`) and clip what exceeds them; they
cost no bytes per token. :mod:`minibatch_engine.model.kv_quant_accuracy` measures all
three.

Quantizing happens once, on write (:func:`write_slots`, the forward's write at
``slot_mapping``), in this module for every attention backend, so every
backend reads the same bytes; each backend dequantizes on read
(:func:`read_slots`, or in its kernel). The attention a step computes always
reads its own new tokens' K/V back from the cache too, so a prefill sees the
same quantized keys a later decode will.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
SCALE_GRANULARITIES = ("per_token_head", "per_head", "per_tensor")
SCALE_BYTES = 4          # float32 scales


@dataclass(frozen=True)
class KVFormat:
    """An 8-bit storage format: its name, torch dtype and largest magnitude."""
    name: str
    storage: torch.dtype
    qmax: float


_FORMATS = {"fp8": KVFormat("fp8", torch.float8_e4m3fn, 448.0),
            "int8": KVFormat("int8", torch.int8, 127.0)}


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The format of ``kv_cache_dtype`` (None for ``"auto"``: the model's dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return None
    return _FORMATS["fp8" if kv_cache_dtype.startswith("fp8") else "int8"]


def kv_bytes_per_token(model_config, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                       scale: str = "per_token_head") -> int:
    """Bytes one token's K and V take in every layer: ``2 x layers x kv_heads x
    head_dim x element`` for ``"auto"``; for fp8 and int8 one byte per element
    plus, with per-(token, head) scales, 4 bytes per head for K and for V:
    ``2 x layers x kv_heads x (head_dim + 4)``."""
    fmt = kv_format(kv_cache_dtype)
    if fmt is None:
        return model_config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())
    per_head = model_config.head_dim + (SCALE_BYTES if scale == "per_token_head" else 0)
    return 2 * model_config.num_layers * model_config.num_kv_heads * per_head


def quantize(x: torch.Tensor, fmt: KVFormat, scale: torch.Tensor | None = None):
    """``(stored, scale)``: ``x`` ``[..., head_dim]`` in ``fmt``. ``scale=None``:
    one float32 scale per row, ``max|row| / qmax`` (an all-zero row gets the
    smallest normal float so nothing divides by zero); else the given scale,
    broadcast over the rows, and values beyond ``qmax * scale`` are clipped."""
    if scale is None:
        amax = x.abs().amax(dim=-1).to(torch.float32)
        scale = (amax / fmt.qmax).clamp_min(torch.finfo(torch.float32).tiny)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = (x.to(work) / scale[..., None].to(work)).clamp(-fmt.qmax, fmt.qmax)
    stored = (y.round() if fmt.storage == torch.int8 else y).to(fmt.storage)
    return stored, scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``stored * scale`` in ``dtype`` (the inverse of :func:`quantize`, up to rounding)."""
    return stored.to(dtype) * scale[..., None].to(dtype)


class QuantizedSlots:
    """One layer's K (or V) slots in 8 bits: ``data`` ``[num_slots, kv_heads,
    head_dim]`` and ``scale``: ``[num_slots, kv_heads]`` float32 (per token and
    head, written with the data) or ``[kv_heads]`` (static, per head or per
    tensor). What :meth:`~minibatch_engine.kv.KVPool.layer` hands the attention
    backends when the pool is quantized."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, fmt: KVFormat):
        self.data, self.scale, self.fmt = data, scale, fmt
        self.dynamic = scale.dim() == 2

    @property
    def shape(self):
        return self.data.shape

    @property
    def device(self):
        return self.data.device

    def slot_scales(self) -> torch.Tensor:
        """The scales as ``[num_slots, kv_heads]`` (a stride-0 view when static)."""
        return self.scale if self.dynamic else self.scale.expand(self.data.shape[:2])

    def write(self, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize ``x`` ``[T, kv_heads, head_dim]`` into the slots ``slot_mapping``."""
        stored, scale = quantize(x, self.fmt, None if self.dynamic else self.scale)
        # index_copy_ has no float8 kernel on the CPU: copy the bytes
        self.data.view(torch.uint8).index_copy_(0, slot_mapping, stored.view(torch.uint8))
        if self.dynamic:
            self.scale.index_copy_(0, slot_mapping, scale)

    def read(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The slots ``index`` (any shape) dequantized: ``[*index.shape, kv_heads, head_dim]``."""
        return dequantize(self.data[index], self.scale[index] if self.dynamic else self.scale, dtype)

    def read_blocks(self, block_size: int, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Whole blocks ``table`` (any shape) dequantized: ``[*table.shape, block_size, kv_heads, head_dim]``."""
        h, d = self.data.shape[1:]
        data = self.data.view(-1, block_size, h, d)[table]
        scale = self.scale.view(-1, block_size, h)[table] if self.dynamic else self.scale
        return dequantize(data, scale, dtype)


def write_slots(cache, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """The forward's KV write: ``x`` into ``cache`` at ``slot_mapping`` (quantized
    when the cache is)."""
    if isinstance(cache, QuantizedSlots):
        cache.write(slot_mapping, x)
    else:
        cache.index_copy_(0, slot_mapping, x)


def read_slots(cache, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cache[index]``, dequantized to ``dtype`` when the cache is quantized."""
    return cache.read(index, dtype) if isinstance(cache, QuantizedSlots) else cache[index]


def read_blocks(cache, block_size: int, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks of ``cache`` ``[*table.shape, block_size, kv_heads, head_dim]``,
    dequantized when the cache is quantized."""
    if isinstance(cache, QuantizedSlots):
        return cache.read_blocks(block_size, table, dtype)
    h, d = cache.shape[1:]
    return cache.view(-1, block_size, h, d)[table]


def is_quantized(cache) -> bool:
    return isinstance(cache, QuantizedSlots)
