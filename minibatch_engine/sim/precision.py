"""Bytes per element in the simulator: the KV cache's dtype and the weights'.

Decode is bound by the bytes it reads (chapter 1): every weight once per step,
and every cached K and V of every running sequence. Storing either in fewer
bytes shortens a decode step in proportion, and a KV cache in fewer bytes holds
more tokens in the same memory. The simulator prices both by their bytes alone:

* ``kv_cache_dtype`` (vLLM's knob): ``"auto"`` is bf16, 2 bytes; ``"fp8"``
  (float8 e4m3, also spelled ``"fp8_e4m3"``) and ``"int8"`` 1 byte, plus the
  float32 scale per token and KV head that the engine's quantized cache stores
  for K and for V (:mod:`minibatch_engine.kv.quant`): ``head_dim + 4`` bytes per
  head instead of ``2 x head_dim``, 52% of bf16 at head_dim 128. (vLLM's fp8
  cache keeps one scale per tensor: 50%.)
* ``weight_dtype``: the projections' weights (QKV, O, gate/up, down); the
  embedding, the LM head and the norms stay bf16, as AWQ, GPTQ and vLLM's fp8
  checkpoints keep them. ``"auto"`` is bf16 (2 bytes), ``"fp8"`` 1 byte,
  ``"int4"`` half a byte plus a bf16 scale and zero point per group of
  :data:`INT4_GROUP_SIZE` weights (AWQ's and GPTQ's default group).

What this does not know, because ``data/gpu-profiles/`` holds bf16 GEMMs only:
no fp8 or int4 GEMM kernel was measured, so a quantized projection is priced
as the fitted bf16 GEMM reading fewer weight bytes, at bf16's FLOP rate (H100's
fp8 tensor cores peak at twice it; an int4 weight is dequantized to bf16 before
the multiply, and that dequantization's cost is not priced either). Memory-bound
decode steps are the ones this prices best; compute-bound prefill gains nothing
here, though fp8 GEMMs would gain there on real hardware.
"""
from __future__ import annotations

import math

from ..model.config import ModelConfig

ACTIVATION_BYTES = 2                       # bf16 activations, embeddings, LM head, norms
KV_CACHE_DTYPES: dict[str, int] = {"auto": 2, "fp8": 1, "fp8_e4m3": 1, "int8": 1}
KV_SCALE_BYTES = 4                         # a float32 scale per token and KV head, for K and for V
INT4_GROUP_SIZE = 128
WEIGHT_DTYPES: dict[str, float] = {"auto": 2.0, "fp8": 1.0,
                                   "int4": 0.5 + 2 * ACTIVATION_BYTES / INT4_GROUP_SIZE}


def _bytes_of(table: dict, name: str, dtype):
    """``table[dtype]``, or a ValueError naming the knob ``name`` and its choices."""
    try:
        return table[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"{name} must be one of {', '.join(table)}, got {dtype!r}") from None


def kv_bytes_per_element(kv_cache_dtype: str) -> int:
    """Bytes one cached K or V element takes (``"auto"``: bf16, 2)."""
    return _bytes_of(KV_CACHE_DTYPES, "kv_cache_dtype", kv_cache_dtype)


def kv_bytes_per_token_head(head_dim: int, kv_cache_dtype: str) -> int:
    """Bytes of one token's K (or V) in one KV head: the elements and, when
    quantized, their scale (the engine's per-(token, head) scales)."""
    elem = kv_bytes_per_element(kv_cache_dtype)
    return head_dim * elem + (KV_SCALE_BYTES if elem < ACTIVATION_BYTES else 0)


def weight_bytes_per_element(weight_dtype: str) -> float:
    """Bytes one projection weight takes, scales included (``"auto"``: bf16, 2)."""
    return _bytes_of(WEIGHT_DTYPES, "weight_dtype", weight_dtype)


def projection_parameters(model: ModelConfig) -> int:
    """Weights in the layers' projections (QKV, O, the MLP's or every expert's),
    all layers: the part that weight quantization shrinks."""
    d, hd = model.hidden_size, model.head_dim
    attn = d * (model.num_heads + 2 * model.num_kv_heads) * hd + model.num_heads * hd * d
    return model.num_layers * attn + model.mlp_parameters()


def weight_bytes(model: ModelConfig, weight_dtype: str = "auto") -> int:
    """Bytes of all of ``model``'s weights with its projections in ``weight_dtype``
    and the rest (embeddings, LM head, norms, biases) in bf16 (rounded up)."""
    projections = projection_parameters(model)
    rest = model.num_parameters() - projections
    return math.ceil(projections * weight_bytes_per_element(weight_dtype) + rest * ACTIVATION_BYTES)
