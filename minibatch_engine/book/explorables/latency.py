"""Latency distributions side by side (chapters 7 and 8): each request's TTFT
and TPOT (or end-to-end latency) for several runs; the reader picks a group
(a request class, an arrival rate), a percentile and the SLO, and the page
computes each run's percentile (``MBE.percentile``, numpy's linear rule), the
share of requests meeting the SLO and, for a run with a steady-state window,
its goodput (``MBE.goodput``, as :func:`minibatch_engine.harness.sweep.steady_metrics`).

:func:`policy_latency` builds chapter 7's from its policy runs and
:func:`sweep_latency` chapter 8's from its load sweep; both add checks that
compare the page with the chapter's own numbers (``group_summary``, the
sweep's rows).
"""
from __future__ import annotations

from typing import Mapping, Sequence


from ...harness.metrics import request_metrics
from ...harness.workload import CLASS_WORKLOADS
from ..plotting import COLORS
from .base import Explorable

#: the SLO slider's stops, in ms
SLO_STOPS = [5, 10, 20, 30, 50, 75, 100, 150, 250, 500, 750, 1000, 1500, 2000, 3000, 5000,
             7500, 10000, 15000, 20000, 30000, 60000]
PALETTE = ["#dd8452", "#4c72b0", "#64b5cd", "#55a868", "#8172b2", "#c44e52"]


def _slug(label: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in label.lower()).strip("-")


def _color(label: str, i: int) -> str:
    return COLORS.get(label, PALETTE[i % len(PALETTE)])


def latency_explorer(name: str, selectors: Sequence[Mapping], cells: Mapping[str, Sequence[Mapping]],
                     metrics: Sequence[tuple[str, str]], slo: Mapping[str, Mapping],
                     cell_slo: Mapping[str, Mapping[str, float]] | None = None, percentile: int = 99,
                     checks: Sequence[Mapping] = (), title: str = "", note: str = "") -> Explorable:
    """``selectors``: ``[{"name", "label", "type": "select"|"range", "options",
    "value"}]``; ``cells``: ``{"i,j": [run, ...]}`` for each combination of the
    selectors' option indexes, a run being ``{"key", "label", "color", METRIC:
    [ms or None per request], "arrival": [s], "window": [start, end]}``
    (arrival and window only for goodput); ``metrics``: ``[(key, label)]``;
    ``slo``: ``{key: {"label", "value"}}`` (its slider steps through
    :data:`SLO_STOPS`); ``cell_slo``: an SLO per cell."""
    for key, spec in slo.items():
        if spec["value"] not in SLO_STOPS:
            raise ValueError(f"latency_explorer: the {key} SLO {spec['value']} ms is not one of {SLO_STOPS}")
    for key, own in (cell_slo or {}).items():
        bad = [v for v in own.values() if v not in SLO_STOPS]
        if bad:
            raise ValueError(f"latency_explorer: cell {key}'s SLO {bad} is not one of {SLO_STOPS}")
    data = {"selectors": list(selectors), "cells": dict(cells), "metrics": [list(m) for m in metrics],
            "slo": {k: {**v, "values": SLO_STOPS} for k, v in slo.items()},
            "cell_slo": dict(cell_slo or {}), "percentile": percentile, "note": note}
    return Explorable(name, "latency", data, checks, title=title)


def _ms(x):
    return None if x is None else round(float(x) * 1e3, 4)


def policy_latency(runs: Mapping[str, tuple], workload: str = "mixed-classes",
                   stats: Mapping[str, Mapping] | None = None) -> Explorable:
    """Chapter 7: ``runs``: ``{policy: ((engine, requests), specs)}`` on the same
    arrivals of a class workload; one group per request class, with the
    class's (TTFT, E2E) SLO. ``stats`` (``{policy: by_group(...)}``): checks
    that the page's p50/p99 TTFT and E2E and SLO attainment are the chapter's."""
    if workload not in CLASS_WORKLOADS:
        raise ValueError(f"policy_latency: {workload!r} is not a class workload "
                         f"({', '.join(CLASS_WORKLOADS)})")
    classes = [c.name for c in CLASS_WORKLOADS[workload]]
    slo_s = {c.name: (c.slo_ttft_s, c.slo_e2e_s) for c in CLASS_WORKLOADS[workload]}
    cells, cell_slo = {}, {}
    for c, cls in enumerate(classes):
        group = []
        for i, (policy, ((engine, reqs), specs)) in enumerate(runs.items()):
            ttft, e2el = [], []
            for r, s in zip(reqs, specs):
                if s.request_class != cls:
                    continue
                m = request_metrics(r, engine.trace).seconds["sim"] if r.token_steps else None
                ttft.append(_ms(m["ttft"]) if m else None)
                e2el.append(_ms(m["e2e"]) if m else None)
            group.append({"key": _slug(policy), "label": policy, "color": _color(policy, i),
                          "ttft": ttft, "e2el": e2el})
        cells[str(c)] = group
        cell_slo[str(c)] = {"ttft": slo_s[cls][0] * 1e3, "e2el": slo_s[cls][1] * 1e3}
    checks = []
    for c, cls in enumerate(classes):
        for p in (50, 99):
            expect = {}
            for policy in runs:
                if stats is None or cls not in stats[policy]:
                    continue
                g = stats[policy][cls]
                expect[f"{_slug(policy)}-ttft"] = g[f"ttft_p{p}_s"] * 1e3
                expect[f"{_slug(policy)}-e2el"] = g[f"e2e_p{p}_s"] * 1e3
                expect[f"{_slug(policy)}-met"] = g["slo_attainment"]
            if expect:
                checks.append({"set": {"class": c, "percentile": p}, "expect": expect})
    first = classes[0]
    return latency_explorer(
        "ch7-policies",
        [{"name": "class", "label": "request class", "type": "select", "options": list(classes), "value": 0}],
        cells, [("ttft", "TTFT"), ("e2el", "E2E")],
        {"ttft": {"label": "TTFT", "value": slo_s[first][0] * 1e3},
         "e2el": {"label": "E2E", "value": slo_s[first][1] * 1e3}},
        cell_slo=cell_slo, checks=checks,
        title="The same arrivals under each policy: pick a class, a percentile, an SLO",
        note="A request meets the SLO when both its TTFT and its end-to-end latency are within it.")


def sweep_latency(curves: Mapping[str, Sequence[Mapping]], slo_ms: Mapping[str, float],
                  rate_index: int = 0) -> Explorable:
    """Chapter 8: ``curves``: ``{engine: sweep rows}`` whose rows carry
    ``latencies`` (:func:`minibatch_engine.harness.sweep.sweep`); one group per rate.
    Checks: at the chapter's SLO (``slo_ms``) and p99, the page's TTFT and TPOT
    percentiles, steady-state goodput and SLO attainment (the share of the
    window's arrivals meeting every SLO) equal the rows'."""
    names = list(curves)
    rates = [row["rate"] for row in curves[names[0]]]
    for name, rows in curves.items():
        if [row["rate"] for row in rows] != rates:
            raise ValueError(f"sweep_latency: {name!r} was swept at other rates than {names[0]!r}")
        if any("latencies" not in row for row in rows):
            raise ValueError(f"sweep_latency: the rows of {name!r} have no 'latencies' (sweep keeps them)")
    cells = {}
    for k in range(len(rates)):
        group = []
        for i, name in enumerate(names):
            lat = curves[name][k]["latencies"]
            group.append({"key": _slug(name), "label": name, "color": _color(name, i),
                          "ttft": lat["ttft_ms"], "tpot": lat["tpot_ms"], "arrival": lat["arrival"],
                          "window": lat["window"]})
        cells[str(k)] = group
    checks = []
    for k in range(len(rates)):
        expect = {}
        for name in names:
            row = curves[name][k]
            expect[f"{_slug(name)}-ttft"] = row["ttft_ms_p99"]
            expect[f"{_slug(name)}-tpot"] = row["tpot_ms_p99"]
            if "steady_goodput" in row:
                expect[f"{_slug(name)}-goodput"] = row["steady_goodput"]
            if "steady_slo_attainment" in row:
                expect[f"{_slug(name)}-met"] = row["steady_slo_attainment"]
        checks.append({"set": {"rate": k, "percentile": 99,
                               **{f"slo_{m}": SLO_STOPS.index(v) for m, v in slo_ms.items()}},
                       "expect": expect})
    return latency_explorer(
        "ch8-load",
        [{"name": "rate", "label": "arrival rate", "type": "range",
          "options": [f"{r:g} req/s" for r in rates], "value": rate_index}],
        cells, [("ttft", "TTFT"), ("tpot", "TPOT")],
        {m: {"label": m.upper(), "value": v} for m, v in slo_ms.items()}, checks=checks,
        title="Every engine at one arrival rate: drag the rate, the percentile and the SLO",
        note="'Met the SLO' is the share of the requests that arrived in the steady-state "
             "window and met every SLO; goodput counts them per second of the window.")
