"""Prepacked linear weights for the CPU.

A decode step multiplies a few dozen token rows by every weight matrix. At such
a small ``M`` a CPU GEMM library handed a plain weight spends much of its time
re-laying it out into the panels its micro-kernel wants, on every call. Packing
each weight once removes that work. The engine packs in one of two ways:

* **panels** (float32, where the C++ CPU kernels build): the book's own kernel,
  ``attention/csrc/panel_gemm.cpp``. The weight is copied once into panels of 48
  output columns; a micro-kernel keeps up to 8 rows x 48 columns of the output in
  AVX-512 registers while a panel streams past (the GotoBLAS/BLIS layout). It has
  no fixed cost to speak of: on this book's AMD EPYC it took a fraction of
  plain ``F.linear``'s time at one row and beat oneDNN's packed path from 1 to
  64 rows, about equal at hundreds (appendix, "A linear kernel for a few rows"). Each
  output is one chain of multiply-adds over the input features, whatever rows
  share the call, so a row's result does not depend on its batch.
* **oneDNN** (bfloat16, or no C++ compiler): oneDNN's blocked layout
  (``torch.ops.mkldnn``), which has a fixed cost per call: with an earlier torch
  on the same machine it made a single row about 1.7x slower than plain.

Either way the engine measures before it packs (:func:`linear_times`: each
weight shape timed once at several row counts, the way
``torch.backends.cudnn.benchmark`` picks a convolution) and packs the model's
weights for the steps of at least :func:`packing_rows` rows, the smallest row
count at which packing is at least 5% faster (and not slower at any larger
count); smaller steps take the plain path. The greedy tokens stay equal either
way (chapter 10's ablation and ``benchmarks/vs_transformers.py`` check them).
Inductor packs with ``torch._inductor.config.freezing``; IPEX and vLLM's CPU
backend pack weights too.

:func:`prepack_linear_weights` gives the ``nn.Linear`` layers of a model a
packed copy of their weights and a forward that uses it from a row count on.
The copy follows the weight: if the weight is changed in place (a checkpoint
loaded into the model, ``copy_``), its version counter moves and the next
forward packs again. Only float32 and bfloat16 CPU weights are packed;
anything else keeps the plain ``F.linear``. :func:`unpack_linear_weights`
undoes it.
"""
from __future__ import annotations

import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.cpu_kernel import cpu_kernel_or_none

PACKABLE = (torch.float32, torch.bfloat16)
_BATCH_HINT = 64   # oneDNN chooses its blocking for about this many rows; any M works
# layer -> ((weight id, weight version), packed weight); kept outside the module so
# that copy.deepcopy and state_dict never meet oneDNN's opaque tensors
_PACKED: "weakref.WeakKeyDictionary[nn.Linear, tuple]" = weakref.WeakKeyDictionary()


NO_BIAS = torch.empty(0)   # panel_linear's "no bias" (an empty tensor)


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prepack_available() -> bool:
    """Whether some packed path exists here (oneDNN in this torch build, or the
    C++ CPU kernels)."""
    return _onednn_available() or cpu_kernel_or_none() is not None


def packing_kind(dtype: torch.dtype) -> str | None:
    """How a CPU weight of ``dtype`` is packed here: ``"panels"`` (the book's
    kernel: float32 where the C++ kernels build), ``"onednn"``, or None (not
    packed)."""
    if dtype == torch.float32 and cpu_kernel_or_none() is not None:
        return "panels"
    return "onednn" if dtype in PACKABLE and _onednn_available() else None


class PanelProduct:
    """``F.linear(x, weight, bias)`` from ``weight`` packed once into the panel
    kernel's layout; ``panels`` and ``out_features`` are there for callers that
    hand them to the C++ kernels themselves (:mod:`.flat_forward`)."""

    def __init__(self, kernel, weight: torch.Tensor):
        self.kernel, self.out_features = kernel, weight.shape[0]
        self.panels = kernel.pack_panels(weight)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        out = self.kernel.panel_linear(rows, self.panels, self.out_features, NO_BIAS if bias is None else bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


def pack(weight: torch.Tensor):
    """``weight`` [N, K] packed once; returns ``multiply(x, bias)``, which computes
    ``F.linear(x, weight, bias)`` for ``x`` [..., K] from the packed copy (a
    :class:`PanelProduct` where the weight is packed into panels)."""
    kind, weight, n = packing_kind(weight.dtype), weight.detach(), weight.shape[0]
    if kind == "panels":
        return PanelProduct(cpu_kernel_or_none(), weight)
    if kind == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        return lambda x, bias=None: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    raise ValueError(f"no packed path for a {weight.dtype} weight here")


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if x.shape[0] < self.packed_from_rows if x.dim() == 2 else x.numel() < self.packed_from_rows * x.shape[-1]:
        return F.linear(x, w, self.bias)          # a few rows: the plain path (checked first: it is hot)
    if x.dtype != w.dtype or w.device.type != "cpu" or w.dtype not in PACKABLE or torch.is_grad_enabled():
        return F.linear(x, w, self.bias)
    multiply = packed_product(self)
    if multiply is None:                     # first call, or the weight changed
        multiply = pack(w)
        _PACKED[self] = ((id(w), w._version), multiply)
    return multiply(x, self.bias)


def packed_product(layer: nn.Linear):
    """``layer``'s packed product, ``multiply(x, bias)`` (see :func:`pack`), when
    the layer is switched to its packed copy and that copy is current (packed
    from the weight as it is now); None otherwise (not switched, or not packed
    since the weight changed: its next call packs it)."""
    if layer.__dict__.get("forward") is None:
        return None
    w = layer.weight
    version, multiply = _PACKED.get(layer, (None, None))
    return multiply if version == (id(w), w._version) else None


ROWS = (1, 2, 4, 16, 64)   # the row counts timed: a lone decode up to a full batch
# (in_features, out_features, dtype, threads) -> {rows: (plain, packed) seconds}, as measured
_TIMES: dict[tuple, dict[int, tuple[float, float]]] = {}


@torch.no_grad()
def linear_times(layer: nn.Linear, rounds: int = 5, calls: int = 4) -> dict[int, tuple[float, float]]:
    """Seconds this CPU takes to multiply by ``layer``'s weight, plain ``F.linear``
    and packed, at each row count of :data:`ROWS`: ``calls`` calls, best of
    ``rounds`` alternating rounds, on random data of the layer's shape and
    dtype. Measured once per weight shape, dtype and thread count, then
    remembered."""
    w = layer.weight
    key = (w.shape[1], w.shape[0], w.dtype, torch.get_num_threads())
    if key not in _TIMES:
        weight = torch.randn(w.shape, dtype=w.dtype)
        paths = (lambda x: F.linear(x, weight), pack(weight))
        times = {}
        for m in ROWS:
            x = torch.randn(m, w.shape[1], dtype=w.dtype)
            for path in paths:
                path(x)                                  # first calls: kernel selection
            best = [float("inf"), float("inf")]
            for _ in range(rounds):
                for i, path in enumerate(paths):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        path(x)
                    best[i] = min(best[i], time.perf_counter() - t0)
            times[m] = (best[0], best[1])
        _TIMES[key] = times
    return _TIMES[key]


def _plain_linear(mod: nn.Module) -> bool:
    """An ``nn.Linear`` with an ordinary weight (not a quantized tensor subclass,
    whose own kernels run it: :mod:`minibatch_engine.model.quantization`)."""
    return type(mod) is nn.Linear and type(mod.weight) is nn.Parameter


def _packable(mod: nn.Module) -> bool:
    return _plain_linear(mod) and mod.weight.device.type == "cpu" and packing_kind(mod.weight.dtype) is not None


def packing_rows(model: nn.Module) -> int | None:
    """The smallest row count of :data:`ROWS` at which packing every linear layer
    of ``model`` is faster on this CPU by 5% at least and, at every larger
    count, not slower (:func:`linear_times` summed over the layers; None: at no
    count, so the plain path, the simpler one, stays). One decision for the
    model, since a per-layer choice follows the noise of single timings; the
    larger counts need only not lose, so that a count measured a little under
    5% does not move the start past it."""
    if not prepack_available():
        return None
    times = [linear_times(m) for m in model.modules() if _packable(m)]
    if not times:
        return None
    ratio = {m: sum(t[m][1] for t in times) / sum(t[m][0] for t in times) for m in ROWS}
    return next((m for i, m in enumerate(ROWS)
                 if ratio[m] < 0.95 and all(ratio[n] < 1.0 for n in ROWS[i + 1:])), None)


def prepack_linear_weights(model: nn.Module, only_where_faster: bool = True) -> int:
    """Route the ``nn.Linear`` layers of ``model`` through a packed weight (packed
    lazily, at the first call under ``torch.no_grad``) for inputs of at least
    :func:`packing_rows` rows, or for every input with ``only_where_faster=False``.
    Returns how many layers were switched; 0 when oneDNN is not available or
    packing is faster at no row count."""
    if not prepack_available():
        return 0
    from_rows = packing_rows(model) if only_where_faster else 1
    if from_rows is None:
        return 0
    n = 0
    for mod in model.modules():
        if _plain_linear(mod) and "forward" not in mod.__dict__:
            mod.packed_from_rows = from_rows
            mod.forward = _packed_forward.__get__(mod)
            n += 1
    return n


def packed_from_rows(model: nn.Module) -> int | None:
    """The row count from which ``model``'s packed layers take the packed path
    (None: no layer is packed)."""
    return next((m.packed_from_rows for m in model.modules()
                 if type(m) is nn.Linear and m.__dict__.get("forward") is not None), None)


def num_packed_layers(model: nn.Module) -> int:
    """How many of ``model``'s linear layers run through a packed weight now."""
    return sum(type(m) is nn.Linear and m.__dict__.get("forward") is not None for m in model.modules())


def unpack_linear_weights(model: nn.Module) -> None:
    """Back to plain ``F.linear`` (drops the packed copies)."""
    for mod in model.modules():
        if type(mod) is nn.Linear and mod.__dict__.get("forward") is not None:
            del mod.forward, mod.packed_from_rows
            _PACKED.pop(mod, None)
