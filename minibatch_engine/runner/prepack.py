"""Prepacked linear weights for the CPU (oneDNN's blocked layout).

A decode step multiplies a few dozen token rows by every weight matrix. At such
a small ``M`` a CPU GEMM spends much of its time re-laying the weight out into
the panels its micro-kernel wants, on every call. Packing each weight once, in
oneDNN's layout, removes that work: measured on this book's 2-core CPU, the
linear layers of a decode step run about 1.3-2x faster (chapter 10), and the
engine's greedy tokens stay equal to the unpacked model's
(``benchmarks/vs_transformers.py`` checks them against transformers).
Inductor does the same with ``torch._inductor.config.freezing``; IPEX and
vLLM's CPU backend pack weights too.

:func:`prepack_linear_weights` gives every ``nn.Linear`` of a model a packed copy
of its weight and a forward that uses it. The copy follows the weight: if the
weight is changed in place (a checkpoint loaded into the model, ``copy_``), its
version counter moves and the next forward packs again. Only float32 and
bfloat16 CPU weights are packed (oneDNN has no float64 kernels); anything else
keeps the plain ``F.linear``. :func:`unpack_linear_weights` undoes it.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE = (torch.float32, torch.bfloat16)
_BATCH_HINT = 64   # oneDNN chooses its blocking for about this many rows; any M works
# layer -> ((weight id, weight version), packed weight); kept outside the module so
# that copy.deepcopy and state_dict never meet oneDNN's opaque tensors
_PACKED: "weakref.WeakKeyDictionary[nn.Linear, tuple]" = weakref.WeakKeyDictionary()


def prepack_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if x.dtype != w.dtype or w.device.type != "cpu" or w.dtype not in PACKABLE or torch.is_grad_enabled():
        return F.linear(x, w, self.bias)
    version, packed = _PACKED.get(self, (None, None))
    if version != (id(w), w._version):       # first call, or the weight changed
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _BATCH_HINT)
        _PACKED[self] = ((id(w), w._version), packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")


def prepack_linear_weights(model: nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` through a packed weight (packed lazily,
    at its first call under ``torch.no_grad``). Returns how many layers were
    switched; 0 when oneDNN is not available."""
    if not prepack_available():
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear and "forward" not in mod.__dict__:
            mod.forward = _packed_forward.__get__(mod)
            n += 1
    return n


def unpack_linear_weights(model: nn.Module) -> None:
    """Back to plain ``F.linear`` (drops the packed copies)."""
    for mod in model.modules():
        if type(mod) is nn.Linear and mod.__dict__.get("forward") is not None:
            del mod.forward
            _PACKED.pop(mod, None)
