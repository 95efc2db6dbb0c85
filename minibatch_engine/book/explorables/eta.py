"""Chapter 2's explorable: η of static batching as the spread of output lengths
(σ) and the batch size B change, with the padded layout drawn.

The requests for each σ come from Python (the chapter's workload, one draw per
σ); the browser computes η with ``MBE.etaRun`` in ``static/eta.js``, a port of
:func:`minibatch_engine.book.efficiency.eta_run` (padded layout), and the
browser check compares it with ``eta_run`` at the settings in ``checks``.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..efficiency import eta_run
from .base import Explorable


def eta_explorer(lengths_for: Callable[[float], Sequence[tuple[int, int]]], sigmas: Sequence[float],
                 sigma: float = 1.0, batch: int = 16, max_batch: int = 64,
                 checks: Sequence[tuple[float, int]] = ((1.0, 16), (0.0, 16), (0.5, 4), (2.0, 64), (1.0, 1)),
                 ) -> Explorable:
    """``lengths_for(sigma)``: the (prompt, output) lengths of the requests at
    that σ; ``sigmas``: the grid the σ slider steps through; ``sigma``,
    ``batch``: the starting setting; ``checks``: (σ, B) settings at which the
    page's η must equal :func:`eta_run`'s."""
    sigmas = [round(float(s), 4) for s in sigmas]
    if not sigmas:
        raise ValueError("eta_explorer: sigmas is empty")
    index = {s: i for i, s in enumerate(sigmas)}
    for s in [sigma, *(s for s, _ in checks)]:
        if round(float(s), 4) not in index:
            raise ValueError(f"eta_explorer: sigma {s} is not on the grid {sigmas}")
    lengths = [list(lengths_for(s)) for s in sigmas]
    data = {"sigmas": sigmas, "sigma": index[round(float(sigma), 4)], "batch": batch,
            "max_batch": max_batch,
            "prompt_lengths": [[int(p) for p, _ in ls] for ls in lengths],
            "outputs": [[int(g) for _, g in ls] for ls in lengths]}
    expect = [{"set": {"sigma": index[round(float(s), 4)], "batch": b},
               "expect": {"eta": eta_run(lengths[index[round(float(s), 4)]], b)}}
              for s, b in checks]
    return Explorable("ch2-eta", "eta", data, expect,
                      title="Static batching: drag σ and B, watch η and the padding")
