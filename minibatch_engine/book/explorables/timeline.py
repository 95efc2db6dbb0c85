"""A step scrubber over engine traces (chapters 3, 5 and 6): drag the step
and see who is in the batch, what each row computes (prefill, decode,
padding), who finishes, joins or is preempted, and the step's figures.

:func:`trace_panel` turns one run's trace into a panel (rows are the KV rows
of the batch, ``rows="lanes"``, or the requests, ``rows="requests"``, as in
:func:`~minibatch_engine.book.plotting.request_timeline`);
:func:`step_scrubber` puts panels side by side (one variant) or behind a
selector (several runs of one knob). The browser sums the token rows of the
steps up to the one shown; ``checks`` compare those sums with the trace's
own counts (``computed_tokens``, padding) at the last step.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ...harness.metrics import request_metrics
from ..plotting import _lane_rows
from .base import Explorable

KINDS = [("idle", "var(--mbe-idle)"), ("waiting", "var(--mbe-waiting)"),
         ("prefill", "var(--mbe-prefill)"), ("decode", "var(--mbe-decode)"),
         ("pad", "var(--mbe-pad)"), ("preempted", "var(--mbe-pad)"), ("swapped", "#8172b2")]
KIND = {k: i for i, (k, _) in enumerate(KINDS)}


def trace_panel(trace, key: str, label: str, rows: str = "lanes",
                request_ids: Sequence[str] | None = None,
                arrival_steps: Mapping[str, int] | None = None,
                series: Sequence[Mapping] = ()) -> dict:
    """One run as a panel. ``key``: names its outputs on the page (``KEY-rows``,
    ``KEY-pad`` (lanes only), ``KEY-step-rows``, ``KEY-SERIES``); ``rows``: ``"lanes"`` (a
    row per KV row or first block) or ``"requests"`` (a row per request of
    ``request_ids``, with waiting, preempted and swapped-out stretches;
    ``arrival_steps``: when each starts waiting, default step 0); ``series``:
    ``[{"key", "label", "values" (one per step, None for none), "unit",
    "digits", "max" (show the run's largest), "cumulative" (show the sum of
    the steps up to the one shown)}]``."""
    if rows not in ("lanes", "requests"):
        raise ValueError(f"trace_panel: rows must be 'lanes' or 'requests', got {rows!r}")
    steps = trace.steps
    requests: list[str] = []
    index: dict[str, int] = {}

    def req(rid):
        if rid not in index:
            index[rid] = len(requests)
            requests.append(rid)
        return index[rid]

    events: dict[str, list[str]] = {}
    started: set[str] = set()
    last_step: dict[str, int] = {}
    for t, s in enumerate(steps):
        for lane in s.lanes:
            if lane.kind != "pad":
                last_step[lane.request_id] = t
    for rid, t in last_step.items():
        events.setdefault(str(t), []).append(f"{rid} finishes")
    out_steps = []
    if rows == "lanes":
        n_rows, lane_rows = _lane_rows(steps)
        row_labels = [f"row {i}" for i in range(n_rows)]
        for t, (s, rws) in enumerate(zip(steps, lane_rows)):
            cells = []
            for lane, r in sorted(zip(s.lanes, rws), key=lambda lr: lr[0].kind != "pad"):
                if r < 0:
                    continue
                cells.append([r, KIND[lane.kind], lane.num_tokens, req(lane.request_id)])
                if lane.kind == "prefill" and lane.request_id not in started:
                    started.add(lane.request_id)
                    events.setdefault(str(t), []).insert(0, f"{lane.request_id} joins (row {r})")
            out_steps.append(cells)
    else:
        ids = list(request_ids or [])
        if not ids:
            raise ValueError("trace_panel: rows='requests' needs request_ids")
        row = {rid: i for i, rid in enumerate(ids)}
        for rid in ids:
            req(rid)
        arrivals = arrival_steps or {rid: 0 for rid in ids}
        row_labels = ids
        state: dict[str, str | None] = {rid: None for rid in ids}
        for t, s in enumerate(steps):
            for rid, a in arrivals.items():
                if a == t and rid in row:
                    state[rid] = "waiting"
            for p in s.preempted:
                if p.request_id in row:
                    state[p.request_id] = "preempted" if p.mode == "recompute" else "swapped"
                    events.setdefault(str(t), []).append(f"{p.request_id} preempted ({p.mode})")
            ran: dict[str, list] = {}
            for lane in s.lanes:
                if lane.request_id in row and lane.kind != "pad":
                    ran.setdefault(lane.request_id, []).append(lane)
            cells = []
            for rid in ids:
                if rid in ran:
                    for lane in ran[rid]:
                        cells.append([row[rid], KIND[lane.kind], lane.num_tokens, row[rid]])
                    state[rid] = None
                elif state[rid] is not None:
                    cells.append([row[rid], KIND[state[rid]], 0, row[rid]])
            out_steps.append(cells)
    finish = {}
    if rows == "requests":  # a row is one request: when it is done
        finish = {str(index[rid]): t for rid, t in last_step.items() if rid in index}
    return {"key": key, "label": label, "rows": row_labels, "requests": requests, "steps": out_steps,
            "events": events, "finish": finish, "pad": rows == "lanes",
            "series": [dict(s) for s in series]}


def step_scrubber(name: str, variants: Mapping[str, Sequence[dict]], title: str = "",
                  row_label: str = "KV row", variant_label: str = "run", variant: int = 0,
                  step: int = 0, checks: Sequence[Mapping] = ()) -> Explorable:
    """Panels of :func:`trace_panel` behind a step slider; several variants
    (``{label: [panel, ...]}``) get a selector named ``variant_label``.
    ``checks``: ``[{"set": {"variant": i, "step": t}, "expect": {output: value}}]``;
    :func:`totals_check` builds the usual one."""
    if not variants:
        raise ValueError("step_scrubber: no variants")
    data = {"kinds": KINDS, "row_label": row_label, "variant_label": variant_label,
            "variant": variant, "step": step,
            "variants": [{"label": k, "panels": list(v)} for k, v in variants.items()]}
    return Explorable(name, "timeline", data, checks, title=title)


def totals_check(traces: Mapping[str, object], variant: int | None = None) -> dict:
    """The check at the last step (of ``variant``, when there are several):
    each panel's token rows and padding rows so far equal its trace's
    ``computed_tokens`` and padding."""
    last = max(len(tr) for tr in traces.values()) - 1
    expect = {}
    for key, tr in traces.items():
        expect[f"{key}-rows"] = tr.computed_tokens
        expect[f"{key}-pad"] = tr.computed_tokens - tr.useful_tokens
    where = {} if variant is None else {"variant": variant}
    return {"set": {**where, "step": last}, "expect": expect}


def preemption_panel(engine, requests, label: str = "") -> dict:
    """Chapter 6: a run under KV pressure, one row per request (waiting,
    prefill or recompute, decode, preempted, swapped out), with the KV tokens
    held, the MiB swapped so far (summed on the page) and the simulated clock."""
    trace, kv = engine.trace, engine.kv_cache
    per_token = kv.bytes_per_block / kv.block_size
    capacity = round(trace[0].kv_capacity_bytes / per_token) if len(trace) else 0
    series = [
        {"key": "kv", "label": "KV tokens held", "unit": f"of {capacity}", "digits": 0,
         "values": [s.kv_reserved_bytes / per_token for s in trace.steps]},
        {"key": "swap", "label": "MiB swapped so far", "digits": 1, "cumulative": True,
         "values": [s.swap_bytes / 2**20 for s in trace.steps]},
        {"key": "time", "label": "simulated time", "unit": "s", "digits": 3,
         "values": [s.sim_end for s in trace.steps]},
    ]
    return trace_panel(trace, "run", label, rows="requests",
                       request_ids=[r.request_id for r in requests], series=series)


def preemption_check(variant: int, engine) -> dict:
    """At the run's last step: the token rows computed (recomputation included),
    the MiB swapped and the simulated end time, as the chapter computes them."""
    tr = engine.trace
    return {"set": {"variant": variant, "step": len(tr) - 1},
            "expect": {"run-rows": tr.computed_tokens,
                       "run-swap": sum(s.swap_bytes for s in tr.steps) / 2**20,
                       "run-time": tr.end_time("sim")}}


def itl_panel(engine, watched, label: str = "") -> dict:
    """Chapter 5: every request of a run, one row each (a prompt's chunks show
    step by step), with each step's simulated length and the gap before the
    token ``watched`` (a request) received in that step, if any; the page
    shows the run's largest of both."""
    trace = engine.trace
    reqs = list(engine.requests.values())
    gaps: list[float | None] = [None] * len(trace)
    itl = request_metrics(watched, trace).seconds["sim"]["itl"]
    for k, g in zip(watched.token_steps[1:], itl):
        gaps[k] = g * 1e3
    series = [
        {"key": "dt", "label": "step length", "unit": "ms", "digits": 1, "max": True,
         "values": [(s.sim_end - s.sim_start) * 1e3 for s in trace.steps]},
        {"key": "itl", "label": f"{watched.request_id}'s wait for this token", "unit": "ms",
         "digits": 1, "max": True, "values": gaps},
    ]
    return trace_panel(trace, "run", label, rows="requests", request_ids=[r.request_id for r in reqs],
                       arrival_steps={r.request_id: r.arrival_step for r in reqs}, series=series)


def itl_check(variant: int, engine, watched) -> dict:
    """The largest gap between two of ``watched``'s tokens, as the chapter
    computes it (``request_metrics(...).seconds["sim"]["itl"]``), in ms."""
    itl = request_metrics(watched, engine.trace).seconds["sim"]["itl"]
    return {"set": {"variant": variant, "step": 0}, "expect": {"run-itl-max": max(itl) * 1e3}}

