"""Workloads run under a scheduling policy on the simulated GPU, and what each
class or client of requests received (chapter 7).

* :func:`simulate` runs :class:`~minibatch_engine.harness.workload.RequestSpec` s through
  an engine with no model (the simulator's clock), optionally up to a horizon;
* :func:`by_group` summarises a run per class or client
  (:func:`minibatch_engine.harness.bench.group_summary`), :func:`class_table` turns
  several runs' summaries into one table;
* :func:`service_curves` and :func:`backlogged_gap` measure service as the
  Virtual Token Counter counts it (Sheng et al., OSDI'24): ``w_p`` per prompt
  token when a request starts, ``w_q`` per generated token.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from ..harness.bench import group_summary
from ..config import EngineConfig
from ..core.engine import Engine
from ..harness.workload import slo_of
from .report import Table

SIM = dict(sim_gpu="H100-SXM", sim_model="llama-3-8b")   # Llama-3-8B on a simulated H100


def simulate(specs, policy: str = "fcfs", aging: float | None = None, max_num_seqs: int = 8,
             horizon: float | None = None, setup: Callable[[Engine], None] | None = None, **kw):
    """Run workload specs on the simulated H100 (Llama-3-8B shapes); returns
    ``(engine, requests)``. ``horizon``: stop stepping at that simulated time;
    ``setup(engine)``: called before the requests are added."""
    engine = Engine(None, EngineConfig(policy=policy, priority_aging_s=aging,
                                       max_num_seqs=max_num_seqs, **SIM, **kw))
    if setup is not None:
        setup(engine)
    reqs = [engine.add_request(s.prompt_token_ids, s.sampling_params(), arrival_time=s.arrival_time,
                               priority=s.priority, client_id=s.client_id) for s in specs]
    while engine.has_unfinished() and (horizon is None or engine.now() < horizon):
        engine.step()
    return engine, reqs


def by_group(engine: Engine, reqs, specs, key: str = "request_class",
             workload: str = "mixed-classes") -> dict:
    """Per class (or client, ``key="client_id"``): TTFT/E2E percentiles, tokens
    served, SLO attainment, preemptions."""
    groups = [getattr(s, key) for s in specs]
    return group_summary(engine, reqs, groups, [slo_of(s, workload) for s in specs])


def class_table(stats: Mapping[str, Mapping[str, Mapping]]) -> Table:
    """One row per (run, class): TTFT in ms, E2E in s, SLO attainment, preemptions."""
    rows = [[name, cls, g["ttft_p50_s"] * 1e3, g["ttft_p99_s"] * 1e3, g["e2e_p50_s"],
             g["e2e_p99_s"], g["slo_attainment"], g["preempted"]]
            for name, per in stats.items() for cls, g in per.items()]
    return Table(rows, ["policy", "class", "TTFT p50 (ms)", "TTFT p99 (ms)", "E2E p50 (s)",
                        "E2E p99 (s)", "SLO met", "times preempted"], floatfmt=".2f")


def service_curves(engine: Engine, reqs, w_p: float = 1, w_q: float = 2) -> dict:
    """Cumulative weighted service per client over simulated time:
    ``client -> (times, service)``."""
    events: dict = {}
    for r in reqs:
        if r.first_scheduled_step is None:
            continue
        t0 = engine.trace[r.first_scheduled_step].sim_start
        ev = [(t0, w_p * r.num_prompt_tokens)] + [(engine.trace[k].sim_end, w_q) for k in r.token_steps]
        events.setdefault(r.client_id, []).extend(ev)
    out = {}
    for c, ev in events.items():
        ev = np.array(sorted(ev))
        out[c] = (ev[:, 0], np.cumsum(ev[:, 1]))
    return out


def backlogged_gap(engine: Engine, reqs, clients: Sequence[str] = ("a", "b"),
                   points: int = 400) -> tuple[float, float]:
    """The largest difference in service between two clients while both had
    requests waiting (from the later first arrival to the earlier last start),
    and the end of that interval: ``(gap, t_end)``."""
    a, b = clients
    arrive = {c: sorted(r.arrival_time["sim"] for r in reqs if r.client_id == c) for c in clients}
    start = {c: sorted(engine.trace[r.first_scheduled_step].sim_start
                       for r in reqs if r.client_id == c) for c in clients}
    t_end = min(start[c][-1] for c in clients)     # after that, one of them has nothing waiting
    t_begin = max(arrive[c][0] for c in clients)
    grid = np.linspace(t_begin, t_end, points)
    cur = service_curves(engine, reqs)
    at = {c: np.interp(grid, cur[c][0], cur[c][1], left=0) for c in clients}
    return float(np.max(np.abs(at[a] - at[b]))), t_end
