"""Tables and glue for load sweeps (chapter 8): the rows of
:func:`minibatch_engine.harness.sweep.sweep`, one per rate, for one or more engines."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from .glue import glue
from .report import Table

# a sweep row's key -> its column heading
HEADINGS = {
    "rate": "rate",
    "num_requests": "requests",
    "steady_offered_rate": "offered (req/s)",
    "steady_request_throughput": "served (req/s)",
    "request_throughput": "whole run (req/s)",
    "ttft_ms_p50": "TTFT p50 (ms)",
    "ttft_ms_p99": "TTFT p99 (ms)",
    "tpot_ms_p99": "TPOT p99 (ms)",
    "peak_running": "peak running",
    "steady_goodput": "goodput (req/s)",
    "steady_slo_attainment": "met the SLO",
}

SWEEP_COLUMNS = ("rate", "steady_offered_rate", "steady_request_throughput", "ttft_ms_p99",
                 "tpot_ms_p99", "steady_goodput", "steady_slo_attainment")


def _cell(key: str, value):
    if key == "steady_slo_attainment":
        return f"{value:.0%}"
    if key == "rate" and float(value).is_integer():
        return int(value)
    return value


def sweep_table(curves: Mapping[str, Sequence[Mapping]], columns: Sequence[str] = SWEEP_COLUMNS,
                label: str = "engine", floatfmt: str = ",.1f") -> Table:
    """One line per (label, rate): ``curves`` maps a label (an engine) to its
    sweep rows; ``columns`` are row keys, headed as in :data:`HEADINGS`."""
    return Table([[name, *(_cell(k, r[k]) for k in columns)] for name, rows in curves.items() for r in rows],
                 [label, *(HEADINGS.get(k, k) for k in columns)], floatfmt=floatfmt)


def glue_rows(rows: Mapping[str, Mapping], keys: Mapping[str, str]) -> None:
    """Glue ``{prefix}_{name}`` for every ``name: row`` of ``rows`` and every
    ``prefix: key`` of ``keys`` (``{"p": row}``, ``{"burst_ok": "steady_slo_attainment"}``
    -> ``burst_ok_p``)."""
    for name, r in rows.items():
        for prefix, key in keys.items():
            glue(f"{prefix}_{name}", r[key], display=False)


def glue_sweep(curves: Mapping[str, Sequence[Mapping]], keys: Mapping[str, str]) -> None:
    """Glue ``{prefix}_{label}_{rate}`` for every row of every curve and every
    ``prefix: key`` of ``keys`` (``{"ttft": "ttft_ms_p99"}`` -> ``ttft_paged_40``)."""
    for name, rows in curves.items():
        glue_rows({f"{name}_{r['rate']:g}": r for r in rows}, keys)


def closest_pair(a: Sequence[Mapping], b: Sequence[Mapping], key: str = "steady_offered_rate"):
    """The row of ``a`` and the row of ``b`` whose ``key`` values are closest
    (e.g. two arrival patterns at the same measured offered load)."""
    return min(((x, y) for x in a for y in b), key=lambda p: abs(p[0][key] - p[1][key]))


def traffic_stats(arrivals, prompt_lens, output_lens, duration: float | None = None) -> dict:
    """What sets a workload's load: its mean rate over ``duration`` seconds
    (default: first to last arrival), its lengths (median and p99, tokens) and
    its burstiness (the gaps' coefficient of variation, 1 for Poisson
    arrivals; and the busiest second's arrivals over the mean rate)."""
    a, p, o = (np.asarray(x, dtype=float) for x in (arrivals, prompt_lens, output_lens))
    gaps = np.diff(a)
    rate = len(a) / duration if duration else (len(a) - 1) / (a[-1] - a[0])
    busiest = np.bincount((a - a[0]).astype(int)).max()
    return {"requests": len(a), "rate": rate, "prompt_p50": np.median(p), "prompt_p99": np.percentile(p, 99),
            "output_p50": np.median(o), "output_p99": np.percentile(o, 99), "gap_cv": gaps.std() / gaps.mean(),
            "peak_1s": busiest / rate}
