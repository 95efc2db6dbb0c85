"""Load sweeps: one engine configuration under a list of request rates.

Each rate is one run of the same seeded workload with arrivals at that mean
rate (Poisson, or bursty with ``burstiness < 1``), summarised with vLLM's
serving metrics (:mod:`minibatch_engine.harness.metrics`). Plotted against the rate,
latency stays flat while the engine keeps up, bends at the *knee*, and then
climbs without bound once arrivals outpace service: queues only grow. Goodput,
the rate of requests that meet the SLO, rises with the rate and then falls.

Each row also carries the run's *steady state* (:func:`steady_metrics`):
a run of N requests starts empty and ends with a drain (the last requests
decode after the last arrival), and vLLM's counts, per second from the first
arrival to the last token, put both in the denominator, so even an engine that
keeps up shows less than the offered rate. The ``steady_*`` keys count over a
window instead: from the end of a warm-up share of the arrival span to the last
arrival, the arrivals (the offered rate), the completions (throughput) and the
arrivals that met every SLO (goodput), each per second of the window.

Two ways to run a rate:

* the simulator (``sim_gpu``, ``sim_model``): the engine's clock is the
  cost model's, arrivals are released on it: deterministic, fast, any
  GPU;
* the real model on the wall clock, through :class:`~minibatch_engine.entrypoints.async_llm.AsyncLLM`
  and the open-loop client: requests are sent at their arrival times whether
  or not earlier ones have returned, and latencies are what the client saw.
"""
from __future__ import annotations

import asyncio
import json
import math
from typing import Callable, Iterable, Mapping, Sequence

from tqdm.auto import tqdm

from .bench import run_bench, summarize
from .bench import warmup as warm_up_model
from .metrics import (DEFAULT_PERCENTILES, RequestTiming, meets_slo, parse_goodput, parse_percentiles,
                      serving_metrics, timings_from_trace)
from .workload import make_workload

STEADY_WARMUP = 0.2   # the share of the arrival span left out at the start of the window


def parse_rates(text: str | Sequence[float]) -> list[float]:
    """``"1,2,4"`` (``--rates``) -> ``[1.0, 2.0, 4.0]``; each > 0."""
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        rates = [float(x) for x in items]
    except (TypeError, ValueError):
        raise ValueError(f"rates must be numbers in requests/s, as 1,2,4; got {text!r}") from None
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise ValueError(f"rates must be finite and > 0 requests/s, got {text!r}")
    return rates


def steady_window(timings: Sequence[RequestTiming], warmup: float = STEADY_WARMUP) -> tuple[float, float]:
    """The steady-state window of a run: ``(start, end)``, seconds in the
    timings' clock. It ends at the last arrival, when the offered load stops,
    and starts ``warmup`` of the way from the first arrival to the last, after
    the engine has filled up from empty."""
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup is a share of the arrival span in [0, 1), got {warmup!r}")
    if not timings:
        raise ValueError("no requests: a window needs arrivals")
    arrivals = [t.arrival for t in timings]
    first, last = min(arrivals), max(arrivals)
    return first + warmup * (last - first), last


def steady_metrics(timings: Sequence[RequestTiming], goodput=None, warmup: float = STEADY_WARMUP) -> dict:
    """Throughput and goodput in the steady state, counted inside the window of
    :func:`steady_window` (``start < t <= end``) and divided by its length:

    * ``steady_offered_rate``: arrivals, per second: the load that was sent;
    * ``steady_request_throughput``: requests whose last token came in the
      window, per second: the load that was served;
    * ``steady_output_throughput``: output tokens that came in the window, per second;
    * with SLOs (ms, as :func:`~minibatch_engine.harness.metrics.parse_goodput`),
      ``steady_slo_attainment``: the share of the window's arrivals that met
      every SLO, and ``steady_goodput``: those requests per second (attainment
      times the offered rate), vLLM's goodput over the window.

    An engine that keeps up completes what arrives: its throughput matches the
    offered rate, and counting good requests by arrival or by completion gives
    the same rate. One that does not keep up has no steady state: it completes
    what it can serve, its queue grows, and each request is charged to the load
    it arrived with (a count of completions would credit the window with early
    arrivals served before the queue grew). DistServe's goodput is the highest
    rate whose attainment reaches a target (:func:`distserve_goodput`).

    ``timings`` are every request of the run (one with no token counts as
    offered, never as served); the rates are NaN when the window is empty
    (every arrival at one instant)."""
    slo = parse_goodput(goodput)
    start, end = steady_window(timings, warmup)
    span = end - start
    per = (lambda x: x / span) if span > 0 else (lambda x: float("nan"))  # noqa: E731
    inside = lambda t: start < t <= end  # noqa: E731
    arrived = [t for t in timings if inside(t.arrival)]
    s = {"steady_warmup": warmup, "steady_window_s": span,
         "steady_offered_rate": per(len(arrived)),
         "steady_request_throughput": per(sum(bool(t.num_output_tokens) and inside(t.token_times[-1])
                                               for t in timings)),
         "steady_output_throughput": per(sum(inside(x) for t in timings for x in t.token_times))}
    if slo:
        good = sum(bool(t.num_output_tokens) and meets_slo(t, slo) for t in arrived)
        s["steady_slo_attainment"] = good / len(arrived) if arrived else float("nan")
        s["steady_goodput"] = per(good)
    return s


async def realtime_bench(model, workload: str = "uniform", num_requests: int = 32, rate: float = 1.0,
                         burstiness: float = 1.0, seed: int = 0, percentiles=DEFAULT_PERCENTILES,
                         goodput=None, progress: Callable[[int], None] | None = None,
                         warmup: float = STEADY_WARMUP, **engine_options) -> tuple[dict, object]:
    """One rate on the real model, on the wall clock, through ``AsyncLLM`` and
    :func:`~minibatch_engine.entrypoints.async_llm.open_loop`. ``model`` is a built model
    (reused across rates). Returns (summary, engine): the engine's own keys
    (steps, η, KV, ...) plus vLLM's latency keys as the client measured them,
    and the steady-state keys (:func:`steady_metrics`, warm-up ``warmup``)."""
    from ..entrypoints.async_llm import AsyncLLM, open_loop
    ps, slo = parse_percentiles(percentiles), parse_goodput(goodput)
    specs = make_workload(workload, num_requests, seed=seed, vocab_size=min(256, model.config.vocab_size),
                          arrival_rate=rate, burstiness=burstiness)
    async with AsyncLLM(model, **engine_options) as llm:
        records = await open_loop(llm, specs, progress=progress)
        await llm.wait_idle()
    engine = llm.engine
    s = summarize(engine, list(engine.scheduler.requests.values()), ps=ps, goodput=slo)
    s.update(serving_metrics([r.timing for r in records if r.timing.num_output_tokens], ps=ps, goodput=slo))
    s.update(steady_metrics([r.timing for r in records], goodput=slo, warmup=warmup))
    s.update(clock="wall", latency_source="client", workload=workload, num_requests=num_requests,
             arrival_rate=rate, burstiness=burstiness, seed=seed)
    return s, engine


def request_latencies(timings: Sequence[RequestTiming], warmup: float = STEADY_WARMUP) -> dict:
    """Each request's arrival (s), TTFT and TPOT (ms; TPOT None for a one-token
    answer) and the steady-state window: what a sweep row's percentiles and
    goodput are computed from, kept so a reader can recompute them at another
    SLO (chapter 8's explorable)."""
    return {"arrival": [t.arrival for t in timings],
            "ttft_ms": [t.ttft * 1e3 for t in timings],
            "tpot_ms": [t.tpot * 1e3 if t.num_output_tokens > 1 else None for t in timings],
            "window": list(steady_window(timings, warmup)) if timings else None}


def sweep(rates: Iterable[float], *, simulate: bool = True, model="tiny", device: str = "auto",
          dtype: str = "float32", jsonl: str | None = None, progress: bool = True,
          warmup: float = STEADY_WARMUP, min_duration_s: float | None = None,
          **bench_options) -> list[dict]:
    """Run every rate and return one summary row per rate (each also appended
    to the JSON-lines file ``jsonl`` as soon as it is done). ``simulate``: the
    simulator alone (``sim_gpu``, ``sim_model`` in ``bench_options``); else the
    real model on the wall clock. ``bench_options`` are :func:`~minibatch_engine.harness.bench.run_bench`'s
    (``scheduler``, ``workload``, ``num_requests``, ``max_batch``, ``seed``,
    ``burstiness``, ``percentiles``, ``goodput``) and engine options. Each row
    has vLLM's keys over the whole run and the ``steady_*`` keys over the
    steady-state window (:func:`steady_metrics`, warm-up ``warmup``); a
    simulated row also keeps ``latencies`` (:func:`request_latencies`), which
    the JSON-lines file leaves out.
    ``min_duration_s``: at least ``rate * min_duration_s`` requests at each
    rate (``num_requests`` where that is more), so that the arrivals of the
    high rates last as long as the low rates' and their windows hold as many
    seconds."""
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup is a share of the arrival span in [0, 1), got {warmup!r}")
    if min_duration_s is not None and not 0 < min_duration_s < float("inf"):
        raise ValueError(f"min_duration_s must be finite and > 0 seconds, got {min_duration_s!r}")
    rates = parse_rates(list(rates))
    rows = []
    out = open(jsonl, "w") if jsonl else None
    m = None
    if not simulate:
        from ..model.registry import resolve_model
        m = resolve_model(model, device=device, dtype=dtype)
        warm_up_model(m)
    try:
        for rate in tqdm(rates, desc="sweep", unit="rate", disable=not progress):
            opts = dict(bench_options)
            if min_duration_s is not None:
                opts["num_requests"] = max(opts.get("num_requests", 0), math.ceil(rate * min_duration_s))
            if simulate:
                row, eng = run_bench(arrival_rate=rate, simulate_only=True, progress=False, **opts)
                timings = timings_from_trace(eng.requests.values(), eng.trace, "sim")
                row.update(steady_metrics(timings, goodput=opts.get("goodput"), warmup=warmup))
                row["latencies"] = request_latencies(timings, warmup)
            else:
                opts["max_num_seqs"] = opts.pop("max_batch", 256)
                row, _ = asyncio.run(realtime_bench(m, rate=rate, warmup=warmup, **opts))
                row["model"] = model if isinstance(model, str) else m.config.name
            row = {"rate": rate, **row}
            rows.append(row)
            if out is not None:
                out.write(json.dumps({k: v for k, v in row.items() if k != "latencies"}, default=str) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
    return rows


def max_rate_under_slo(rows: Sequence[Mapping], slo_ms: Mapping[str, float], stat: str = "p99") -> float | None:
    """The highest rate of a sweep at which every ``stat`` latency meets its
    bound in ``slo_ms`` (e.g. ``{"ttft": 500, "tpot": 50}``, milliseconds), and
    every lower rate does too (None: not even the lowest)."""
    best = None
    for r in sorted(rows, key=lambda r: r["rate"]):
        if not all(r[f"{k}_ms_{stat}"] <= v for k, v in slo_ms.items()):
            break
        best = r["rate"]
    return best


def distserve_goodput(rows: Sequence[Mapping], attainment: float = 0.9,
                      key: str = "steady_slo_attainment") -> float | None:
    """DistServe's goodput (Zhong et al., 2024): the highest rate of a sweep at
    which at least ``attainment`` of the requests met every SLO (``key``: the
    share, by default in the steady state), and every lower rate too (None:
    not even the lowest). A rate in requests/s, on the sweep's grid of rates;
    not vLLM's goodput, which is a count of good requests per second at one rate."""
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment is a share in (0, 1], got {attainment!r}")
    best = None
    for r in sorted(rows, key=lambda r: r["rate"]):
        if not r[key] >= attainment:
            break
        best = r["rate"]
    return best


def knee(rows: Sequence[Mapping], key: str = "ttft_ms_p99", factor: float = 2.0) -> float | None:
    """The first rate at which ``key`` exceeds ``factor`` times its value at the
    lowest rate: where the latency curve bends up (None: it never does)."""
    rows = sorted(rows, key=lambda r: r["rate"])
    base = rows[0][key]
    for r in rows[1:]:
        if r[key] > factor * base:
            return r["rate"]
    return None
