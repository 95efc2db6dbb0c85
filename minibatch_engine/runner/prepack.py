"""Prepacked linear weights for the CPU (oneDNN's blocked layout).

A decode step multiplies a few dozen token rows by every weight matrix. At such
a small ``M`` a CPU GEMM may spend much of its time re-laying the weight out into
the panels its micro-kernel wants, on every call. Packing each weight once, in
oneDNN's layout, removes that work. Whether it pays depends on the CPU and on
the library behind the plain ``F.linear``: on the AMD EPYC this book was first
measured on, packing made the whole workload of chapter 10 about 15% faster;
on an Intel Xeon with AVX-512, plain ``F.linear`` was about 13% faster instead.
So the engine measures before it packs (:func:`packing_pays`: each weight
shape timed once, the way ``torch.backends.cudnn.benchmark`` picks a
convolution) and packs the model's weights only if that is at least 5% faster.
The greedy tokens stay equal either way (chapter 10's ablation and
``benchmarks/vs_transformers.py`` check them). Inductor packs with
``torch._inductor.config.freezing``; IPEX and vLLM's CPU backend pack weights
too.

:func:`prepack_linear_weights` gives the ``nn.Linear`` layers of a model a
packed copy of their weights and a forward that uses it. The copy follows the
weight: if the weight is changed in place (a checkpoint loaded into the model,
``copy_``), its version counter moves and the next forward packs again. Only float32 and
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


# (in_features, out_features, dtype, threads) -> (plain, packed) seconds, as measured
_TIMES: dict[tuple, tuple[float, float]] = {}


@torch.no_grad()
def linear_times(layer: nn.Linear, rows: tuple[int, ...] = (1, 16, 64), rounds: int = 5,
                 calls: int = 4) -> tuple[float, float]:
    """Seconds this CPU takes to multiply by ``layer``'s weight, plain ``F.linear``
    and packed, over a decode step's range of row counts: ``calls`` calls at each
    of ``rows``, summed, best of ``rounds`` alternating rounds, on random data of
    the layer's shape and dtype. A packed call has a fixed cost of its own (more
    than ten microseconds on some CPUs), so packing can win at 64 rows and lose
    at 1; the sum weighs both. Measured once per weight shape, dtype and thread
    count, then remembered."""
    w = layer.weight
    key = (w.shape[1], w.shape[0], w.dtype, torch.get_num_threads())
    if key not in _TIMES:
        weight = torch.randn(w.shape, dtype=w.dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        xs = [torch.randn(m, w.shape[1], dtype=w.dtype) for m in rows]
        paths = (lambda x: F.linear(x, weight),
                 lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        for path in paths:
            for x in xs:
                path(x)                                  # first calls: kernel selection
        best = [float("inf"), float("inf")]
        for _ in range(rounds):
            for i, path in enumerate(paths):
                t0 = time.perf_counter()
                for x in xs:
                    for _ in range(calls):
                        path(x)
                best[i] = min(best[i], time.perf_counter() - t0)
        _TIMES[key] = (best[0], best[1])
    return _TIMES[key]


def _packable(mod: nn.Module) -> bool:
    return type(mod) is nn.Linear and mod.weight.device.type == "cpu" and mod.weight.dtype in PACKABLE


def packing_pays(model: nn.Module) -> bool:
    """Whether packing every linear layer makes ``model``'s linear layers faster on
    this CPU as a whole (by 5% at least; else the plain path, the simpler one,
    stays): :func:`linear_times` summed over the layers. One decision for the
    model, since a per-layer choice follows the noise of single timings."""
    if not prepack_available():
        return False
    times = [linear_times(m) for m in model.modules() if _packable(m)]
    return bool(times) and sum(t[1] for t in times) < 0.95 * sum(t[0] for t in times)


def prepack_linear_weights(model: nn.Module, only_where_faster: bool = True) -> int:
    """Route the ``nn.Linear`` layers of ``model`` through a packed weight (packed
    lazily, at the first call under ``torch.no_grad``): when :func:`packing_pays`
    for the model, or in any case with ``only_where_faster=False``. Returns how
    many layers were switched; 0 when oneDNN is not available."""
    if not prepack_available() or (only_where_faster and not packing_pays(model)):
        return 0
    n = 0
    for mod in model.modules():
        if type(mod) is nn.Linear and "forward" not in mod.__dict__:
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
