"""Weight quantization: the layers' projections in int8, through torchao.

A decode step reads every weight once (chapter 1), so weights stored in fewer
bytes make a memory-bound step shorter and leave more memory for the KV cache.
Two of torchao's recipes (PyTorch's own quantization library; ``pip install
torchao``), named as vLLM names its ``quantization`` methods:

* ``"int8"``: int8 weights with a scale per output channel, and the
  activations quantized to int8 per token at run time (W8A8 "dynamic"
  quantization, as in LLM.int8's vector-wise scheme without its outlier split
  and SmoothQuant's without smoothing): the matrix product runs on integers.
* ``"int8_weight_only"``: int8 weights with a scale per output channel,
  multiplied with the float activations (W8A16: fewer bytes read, float
  arithmetic); the GPU-serving analogue of AWQ's and GPTQ's int4 weights.

Only the decoder layers' projections (QKV, O, gate/up, down) are quantized;
the embedding and the LM head keep the model's dtype, as AWQ, GPTQ and
vLLM's fp8 checkpoints keep them. The weights are rounded to nearest, with no
calibration data (GPTQ and AWQ choose the rounding or the scales on
calibration text to lose less).

The correctness rule still holds, for the quantized model: every scheduling
mode gives the greedy tokens of the same quantized model recomputed alone. The
tokens may differ from the unquantized model's; chapter 13 measures how often.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

QUANTIZATION_METHODS = ("int8", "int8_weight_only")
_DTYPES = (torch.float32, torch.bfloat16)


@contextlib.contextmanager
def _quiet_torchao():
    """torchao logs a warning for each optional GPU kernel library it cannot
    load on a CPU-only torch, and torch one about an enum torchao registers:
    expected here, not worth a reader's screen."""
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def _config(method: str):
    with _quiet_torchao():
        try:
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
        except ImportError as e:
            raise ValueError(f"quantization={method!r} needs torchao ({e}): pip install torchao") from None
    return Int8DynamicActivationInt8WeightConfig() if method == "int8" else Int8WeightOnlyConfig()


def is_projection(module: nn.Module, name: str) -> bool:
    """A decoder layer's linear layer (not the LM head)."""
    return isinstance(module, nn.Linear) and name.startswith("layers.")


def quantize_weights(model, method: str):
    """Quantize ``model``'s projections in place with ``method`` (one of
    :data:`QUANTIZATION_METHODS`) and return it; ``model.quantization`` records
    the method. The model must be float32 or bfloat16 (torchao's int8 recipes
    take no float64 or float16 activations here)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r} is not one of {', '.join(map(repr, QUANTIZATION_METHODS))} "
                         "(or None for the model's own dtype)")
    if model.dtype not in _DTYPES:
        raise ValueError(f"quantization={method!r} needs a float32 or bfloat16 model, got {model.dtype} "
                         "(pass dtype='float32' or 'bfloat16')")
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"this model is already quantized ({model.quantization!r})")
    config = _config(method)
    from torchao.quantization import quantize_
    with _quiet_torchao(), torch.no_grad():
        quantize_(model, config, filter_fn=is_projection)
    model.quantization = method
    return model


def weight_bytes(model) -> int:
    """Bytes the model's weights take as stored (int8 data and scales counted)."""
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        inner = [getattr(p, a) for a in ("qdata", "scale", "zero_point", "int_data") if hasattr(p, a)]
        total += sum(t.numel() * t.element_size() for t in inner) if inner else p.numel() * p.element_size()
    return total
