"""Prepacked linear weights for the CPU (oneDNN's blocked layout).

A decode step multiplies a few dozen token rows by every weight matrix. At such
a small ``M`` a CPU GEMM may spend much of its time re-laying the weight out into
the panels its micro-kernel wants, on every call. Packing each weight once, in
oneDNN's layout, removes that work. Whether it pays depends on the CPU and on
the library behind the plain ``F.linear``: on the AMD EPYC this book was first
measured on, packing made the whole workload of chapter 10 about 15% faster;
on an Intel Xeon with AVX-512, plain ``F.linear`` was about 13% faster instead.
So the engine measures before it packs (:func:`packing_pays`, once per weight
shape, the way ``torch.backends.cudnn.benchmark`` picks a convolution) and
packs only the layers where packing is faster. The greedy tokens stay equal
either way (chapter 10's ablation and ``benchmarks/vs_transformers.py`` check
them). Inductor packs with ``torch._inductor.config.freezing``; IPEX and vLLM's
CPU backend pack weights too.

:func:`prepack_linear_weights` gives an ``nn.Linear`` a packed copy of its
weight and a forward that uses it. The copy follows the weight: if the weight
is changed in place (a checkpoint loaded into the model, ``copy_``), its
version counter moves and the next forward packs again. Only float32 and
bfloat16 CPU weights are packed (oneDNN has no float64 kernels); anything else
keeps the plain ``F.linear``. :func:`unpack_linear_weights` undoes it.
"""
from __future__ import annotations

import time
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


# (in_features, out_features, dtype, threads) -> whether packing measured faster
_PAYS: dict[tuple, bool] = {}


@torch.no_grad()
def packing_pays(layer: nn.Linear, rows: int = _BATCH_HINT, rounds: int = 5, calls: int = 4) -> bool:
    """Whether this CPU multiplies ``rows`` rows by ``layer``'s weight faster packed
    than with plain ``F.linear``: the best of ``rounds`` alternating rounds of
    ``calls`` calls each, on random data of the layer's shape and dtype. Packing
    must win by 3% (else the plain path, the simpler one, stays). Measured once
    per weight shape, dtype and thread count, then remembered."""
    w = layer.weight
    if w.device.type != "cpu" or w.dtype not in PACKABLE or not prepack_available():
        return False
    key = (w.shape[1], w.shape[0], w.dtype, torch.get_num_threads())
    if key not in _PAYS:
        x = torch.randn(rows, w.shape[1], dtype=w.dtype)
        weight = torch.randn(w.shape, dtype=w.dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        paths = (lambda: F.linear(x, weight), lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None,
                                                                                         "none", [], ""))
        best = [float("inf"), float("inf")]
        for path in paths:
            path()                                       # first calls: kernel selection
        for _ in range(rounds):
            for i, path in enumerate(paths):
                t0 = time.perf_counter()
                for _ in range(calls):
                    path()
                best[i] = min(best[i], time.perf_counter() - t0)
        _PAYS[key] = best[1] < 0.97 * best[0]
    return _PAYS[key]


def prepack_linear_weights(model: nn.Module, only_where_faster: bool = True) -> int:
    """Route the ``nn.Linear`` layers of ``model`` through a packed weight (packed
    lazily, at the first call under ``torch.no_grad``): those where
    :func:`packing_pays`, or every one with ``only_where_faster=False``. Returns
    how many layers were switched; 0 when oneDNN is not available."""
    if not prepack_available():
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear and "forward" not in mod.__dict__ \
                and (not only_where_faster or packing_pays(mod)):
            mod.forward = _packed_forward.__get__(mod)
            n += 1
    return n


def num_packed_layers(model: nn.Module) -> int:
    """How many of ``model``'s linear layers run through a packed weight now."""
    return sum(type(m) is nn.Linear and m.__dict__.get("forward") is not None for m in model.modules())


def unpack_linear_weights(model: nn.Module) -> None:
    """Back to plain ``F.linear`` (drops the packed copies)."""
    for mod in model.modules():
        if type(mod) is nn.Linear and mod.__dict__.get("forward") is not None:
            del mod.forward
            _PACKED.pop(mod, None)
