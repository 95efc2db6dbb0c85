"""The CPU appendix's timing of three ways to run a model's linear layers.

:func:`linear_path_times` times plain ``F.linear``, oneDNN's packed weights and
the engine's packed path (:func:`minibatch_engine.runner.prepack.pack`: the
panel kernel where the C++ kernels build) on the same weight shapes, at several
row counts, in alternating rounds, and keeps each path's best round.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..runner.prepack import pack

PATHS = ("plain", "oneDNN packed", "engine's packed")


@torch.no_grad()
def linear_path_times(shapes, rows=(1, 4, 16, 64, 512), rounds: int = 5, calls: int = 3,
                      seed: int = 0) -> dict[int, dict[str, float]]:
    """Seconds to run one call of every ``(out_features, in_features)`` shape of
    ``shapes`` on ``m`` rows, for each ``m`` of ``rows`` and each path of
    :data:`PATHS`: ``calls`` calls per round, best of ``rounds`` alternating
    rounds, on seeded random float32 data, at torch's current thread count."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) * 0.05 for s in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    engine = [pack(w) for w in weights]
    paths = {
        "plain": lambda x, i: F.linear(x, weights[i]),
        "oneDNN packed": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "engine's packed": lambda x, i: engine[i](x),
    }
    out = {}
    for m in rows:
        xs = [torch.randn(m, w.shape[1], generator=gen) for w in weights]
        best = dict.fromkeys(paths, float("inf"))
        for r in range(rounds):
            order = list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]
            for name in order:
                run = paths[name]
                for i, x in enumerate(xs):
                    run(x, i)                       # first calls outside the clock
                t0 = time.perf_counter()
                for _ in range(calls):
                    for i, x in enumerate(xs):
                        run(x, i)
                best[name] = min(best[name], (time.perf_counter() - t0) / calls)
        out[m] = best
    return out
