"""Per-request latency metrics and run summaries, computed from the trace.

A request's events are step indices; a step's end time in a clock (``wall`` or
``sim``) turns them into seconds. Definitions (the usual serving ones):

* queueing time: arrival -> first scheduled step;
* TTFT (time to first token): arrival -> end of the step that sampled token 1;
* TPOT (time per output token): mean gap between consecutive output tokens;
* end-to-end latency: arrival -> end of the step that sampled the last token.

In steps, an event in step ``k`` of a request that arrived before step ``a``
counts ``k - a + 1`` steps (the steps it lived through).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .request import Request
from .trace import Trace

CLOCKS = ("wall", "sim")


@dataclass
class RequestMetrics:
    num_prompt_tokens: int
    num_output_tokens: int
    queue_steps: int
    ttft_steps: int
    e2e_steps: int
    tpot_steps: float
    itl_steps: list            # gaps between consecutive tokens, in steps
    seconds: dict              # clock -> {"queue", "ttft", "e2e", "tpot", "itl"}


def request_metrics(req: Request, trace: Trace) -> RequestMetrics:
    a = req.arrival_step
    first, last = req.token_steps[0], req.token_steps[-1]
    itl = list(np.diff(req.token_steps).tolist())
    sched = req.first_scheduled_step if req.first_scheduled_step is not None else first
    seconds = {}
    for clock in CLOCKS:
        if getattr(trace[first], f"{clock}_end") is None:
            continue
        end = lambda k: getattr(trace[k], f"{clock}_end")  # noqa: E731
        start = lambda k: getattr(trace[k], f"{clock}_start")  # noqa: E731
        t0 = req.arrival_time.get(clock, start(a) if a < len(trace) else 0.0)
        times = [end(k) for k in req.token_steps]
        gaps = np.diff(times).tolist()
        seconds[clock] = {
            "queue": start(sched) - t0, "ttft": times[0] - t0, "e2e": times[-1] - t0,
            "tpot": float(np.mean(gaps)) if gaps else 0.0, "itl": gaps,
        }
    return RequestMetrics(
        num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
        queue_steps=sched - a, ttft_steps=first - a + 1, e2e_steps=last - a + 1,
        tpot_steps=float(np.mean(itl)) if itl else 0.0, itl_steps=itl, seconds=seconds)


def percentiles(values, ps=(50, 90, 99)) -> dict[str, float]:
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {f"p{p}": float("nan") for p in ps}
    return {f"p{p}": float(np.percentile(arr, p)) for p in ps}
