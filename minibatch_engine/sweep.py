"""Load sweeps: one engine configuration under a list of request rates.

Each rate is one run of the same seeded workload with arrivals at that mean
rate (Poisson, or bursty with ``burstiness < 1``), summarised with vLLM's
serving metrics (:mod:`minibatch_engine.metrics`). Plotted against the rate,
latency stays flat while the engine keeps up, bends at the *knee*, and then
climbs without bound once arrivals outpace service: queues only grow. Goodput,
the rate of requests that meet the SLO, rises with the rate and then falls.

Two ways to run a rate:

* the simulator (``sim_gpu``, ``sim_model``): the engine's clock is the
  cost model's, arrivals are released on it: deterministic, fast, any
  GPU;
* the real model on the wall clock, through :class:`~minibatch_engine.async_llm.AsyncLLM`
  and the open-loop client: requests are sent at their arrival times whether
  or not earlier ones have returned, and latencies are what the client saw.
"""
from __future__ import annotations

import asyncio
import json
from typing import Callable, Iterable, Mapping, Sequence

from tqdm.auto import tqdm

from .bench import run_bench, summarize, warmup
from .metrics import DEFAULT_PERCENTILES, parse_goodput, parse_percentiles, serving_metrics
from .workload import make_workload


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


async def realtime_bench(model, workload: str = "uniform", num_requests: int = 32, rate: float = 1.0,
                         burstiness: float = 1.0, seed: int = 0, percentiles=DEFAULT_PERCENTILES,
                         goodput=None, progress: Callable[[int], None] | None = None,
                         **engine_options) -> tuple[dict, object]:
    """One rate on the real model, on the wall clock, through ``AsyncLLM`` and
    :func:`~minibatch_engine.async_llm.open_loop`. ``model`` is a built model
    (reused across rates). Returns (summary, engine): the engine's own keys
    (steps, η, KV, ...) plus vLLM's latency keys as the client measured them."""
    from .async_llm import AsyncLLM, open_loop
    ps, slo = parse_percentiles(percentiles), parse_goodput(goodput)
    specs = make_workload(workload, num_requests, seed=seed, vocab_size=min(256, model.config.vocab_size),
                          arrival_rate=rate, burstiness=burstiness)
    async with AsyncLLM(model, **engine_options) as llm:
        records = await open_loop(llm, specs, progress=progress)
        await llm.wait_idle()
    engine = llm.engine
    s = summarize(engine, list(engine.scheduler.requests.values()), ps=ps, goodput=slo)
    s.update(serving_metrics([r.timing for r in records if r.timing.num_output_tokens], ps=ps, goodput=slo))
    s.update(clock="wall", latency_source="client", workload=workload, num_requests=num_requests,
             arrival_rate=rate, burstiness=burstiness, seed=seed)
    return s, engine


def sweep(rates: Iterable[float], *, simulate: bool = True, model="tiny", device: str = "auto",
          dtype: str = "float32", jsonl: str | None = None, progress: bool = True,
          **bench_options) -> list[dict]:
    """Run every rate and return one summary row per rate (each also appended
    to the JSON-lines file ``jsonl`` as soon as it is done). ``simulate``: the
    simulator alone (``sim_gpu``, ``sim_model`` in ``bench_options``); else the
    real model on the wall clock. ``bench_options`` are :func:`~minibatch_engine.bench.run_bench`'s
    (``scheduler``, ``workload``, ``num_requests``, ``max_batch``, ``seed``,
    ``burstiness``, ``percentiles``, ``goodput``) and engine options."""
    rates = parse_rates(list(rates))
    rows = []
    out = open(jsonl, "w") if jsonl else None
    m = None
    if not simulate:
        from .model.registry import resolve_model
        m = resolve_model(model, device=device, dtype=dtype)
        warmup(m)
    try:
        for rate in tqdm(rates, desc="sweep", unit="rate", disable=not progress):
            if simulate:
                row, _ = run_bench(arrival_rate=rate, simulate_only=True, progress=False, **bench_options)
            else:
                opts = dict(bench_options)
                opts["max_num_seqs"] = opts.pop("max_batch", 256)
                row, _ = asyncio.run(realtime_bench(m, rate=rate, **opts))
                row["model"] = model if isinstance(model, str) else m.config.name
            row = {"rate": rate, **row}
            rows.append(row)
            if out is not None:
                out.write(json.dumps(row) + "\n")
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


def knee(rows: Sequence[Mapping], key: str = "ttft_ms_p99", factor: float = 2.0) -> float | None:
    """The first rate at which ``key`` exceeds ``factor`` times its value at the
    lowest rate: where the latency curve bends up (None: it never does)."""
    rows = sorted(rows, key=lambda r: r["rate"])
    base = rows[0][key]
    for r in rows[1:]:
        if r[key] > factor * base:
            return r["rate"]
    return None
