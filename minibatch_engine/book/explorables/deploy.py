"""Chapter 14's explorable: choose a model, a GPU, TP, PP and a request rate;
see the fewest GPUs that meet the SLO, their p90 TTFT and TPOT, and the cost
per million output tokens.

Every setting is one planner run (:func:`~minibatch_engine.book.big_models.deploy_point`,
stored with the package), so the page only looks results up
(``static/deploy.js``); the browser check compares what it shows at the
settings in ``checks`` with the stored runs.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from .base import Explorable

OUTPUTS = ("gpus", "ttft_ms", "tpot_ms", "cost_per_mtok")


def deploy_explorer(grid: Mapping[tuple, Mapping], default: tuple, checks: Sequence[tuple],
                    slos: Mapping[str, tuple[float, float]]) -> Explorable:
    """``grid``: ``{(model, gpu, tp, pp, rate): result}`` (results of
    ``deploy_point``); ``default``: the starting setting; ``checks``: settings
    at which the page must show the grid's numbers; ``slos``: each model's p90
    TTFT and TPOT bounds (ms), shown beside it."""
    keys = list(grid)
    axes = [sorted({k[i] for k in keys}, key=lambda v: (str(type(v)), v)) for i in range(5)]
    for k in [default, *checks]:
        if k not in grid:
            raise ValueError(f"deploy_explorer: {k} is not on the grid")
    data = {"models": axes[0], "gpus": axes[1], "tps": axes[2], "pps": axes[3], "rates": axes[4],
            "slos": {m: list(v) for m, v in slos.items()},
            "results": {"|".join(map(str, k)): dict(v) for k, v in grid.items()},
            "default": {"model": default[0], "gpu": default[1], "tp": str(default[2]),
                        "pp": str(default[3]), "rate": axes[4].index(default[4])}}
    expect = []
    for k in checks:
        r = grid[k]
        setting = {"model": k[0], "gpu": k[1], "tp": str(k[2]), "pp": str(k[3]), "rate": axes[4].index(k[4])}
        expect.append({"set": setting, "expect": {o: r[o] for o in OUTPUTS} if r["ok"] else {}})
    return Explorable("ch14-deploy", "deploy", data, expect,
                      title="Deployment explorer: model, GPU, TP, PP and rate to GPUs, latency and cost")
