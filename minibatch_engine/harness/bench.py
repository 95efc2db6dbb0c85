"""The ``bench`` command's core: one workload through one engine configuration,
summarised as a flat dict (the JSON keys every chapter and later issue share)."""
from __future__ import annotations

import json
import platform

import numpy as np
from tqdm.auto import tqdm

from ..config import EngineConfig
from ..core.engine import Engine
from .metrics import (DEFAULT_PERCENTILES, SLO_METRICS, parse_goodput, parse_percentiles, percentiles, request_metrics,
                      serving_metrics, timings_from_trace)
from .workload import make_workload, slo_of


def summarize(engine: Engine, requests, ps=DEFAULT_PERCENTILES, goodput=None) -> dict:
    """Run-level numbers from the trace and the requests: efficiency, memory,
    and vLLM's latency/throughput metrics (see :mod:`minibatch_engine.harness.metrics`)
    at the percentiles ``ps``, with goodput when SLOs (ms) are given."""
    trace = engine.trace
    out_tokens = sum(r.num_output_tokens for r in requests)
    wall = trace.end_time("wall") - trace[0].wall_start if len(trace) else 0.0
    s = {
        "steps": len(trace),
        "useful_tokens": trace.useful_tokens,
        "computed_tokens": trace.computed_tokens,
        "eta": trace.eta(),
        "output_tokens": out_tokens,
        "finished_requests": sum(r.is_finished for r in requests),
        "wall_seconds": wall,
        "output_tokens_per_second": out_tokens / wall if wall > 0 else float("nan"),
        "peak_running": int(trace.column("num_scheduled").max()) if len(trace) else 0,
        # mean share of the batch's max_num_seqs places computing a live request's tokens
        "batch_utilization": float(trace.column("num_scheduled").mean()) / engine.config.max_num_seqs
        if len(trace) else float("nan"),
        "kv_layout": engine.config.kv_layout,
        "kv_capacity_bytes": engine.kv_cache.capacity_bytes,
        "kv_utilization": trace.kv_utilization(),
        "prefix_cache_hit_tokens": sum(r.num_cached_tokens for r in requests),
        "preemptions": sum(r.num_preemptions for r in requests),
        "recomputed_tokens": sum(r.num_recomputed_tokens for r in requests),
        "swapped_bytes": sum(st.swap_bytes for st in trace.steps),
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "chunked_prefill": engine.config.enable_chunked_prefill and engine.config.max_num_batched_tokens is not None,
        "kv_blocks": engine.kv_cache.num_blocks,
        "kv_cache_dtype": engine.config.kv_cache_dtype,
        "kv_bytes_per_token": engine.kv_cache.bytes_per_token,
    }
    spec = engine.config.speculative
    s["speculative_method"] = spec.method if spec else None
    s["num_speculative_tokens"] = spec.num_speculative_tokens if spec else 0
    if spec and spec.method == "draft_model":     # the budget's split between the target's KV and the draft's
        split = engine.kv_split()
        s["kv_budget_bytes"], s["draft_kv_bytes"], s["draft_kv_blocks"] = (
            split["kv_budget_bytes"], split["draft_kv_bytes"], split["draft_kv_blocks"])
    if spec:
        s["spec_proposed_tokens"] = sum(st.spec_proposed for st in trace.steps)
        s["spec_accepted_tokens"] = sum(st.spec_accepted for st in trace.steps)
        s["acceptance_rate"] = trace.acceptance_rate()
        s["mean_accepted_per_verification"] = trace.mean_accepted_per_verification()
        draft = sum(st.draft_s for st in trace.steps)
        s["draft_time_fraction"] = draft / wall if wall > 0 else float("nan")
        if engine.cost_model is not None:
            s["sim_draft_time_fraction"] = sum(st.draft_sim_s or 0.0 for st in trace.steps) / trace.end_time("sim")
    if engine.cost_model is not None:
        cm = engine.cost_model
        s["sim_parallelism"] = {"tensor": cm.tp, "pipeline": cm.pp, "expert": cm.ep, "gpus": cm.num_gpus}
        s["sim_seconds"] = trace.end_time("sim")
        s["sim_output_tokens_per_second"] = out_tokens / s["sim_seconds"]
    if engine.model is not None and engine.model.device.type == "cpu" and len(trace):
        # the run against this CPU's limit for the model (minibatch_engine.harness.machine_limit)
        from .machine_limit import run_against_limit
        lim = run_against_limit(trace, engine.model_config, engine.model.dtype)
        s.update({f"machine_{k}": v for k, v in lim.items()})
    step_wall = sum(st.wall_dt for st in trace.steps)
    in_model = sum(st.forward_s + st.sample_s for st in trace.steps)
    # Share of step time outside the model forward and sampling: scheduling,
    # input preparation, bookkeeping. Only meaningful with a real model.
    s["overhead_fraction"] = 1 - in_model / step_wall if step_wall > 0 and in_model > 0 else float("nan")
    # Engine steps: this book's own clock (chapters 2-6 read ttft/e2e/itl_steps_*).
    ms = [request_metrics(r, trace) for r in requests if r.token_steps]
    for name in ("ttft", "e2e", "itl"):
        steps = [g for m in ms for g in m.itl_steps] if name == "itl" else [getattr(m, f"{name}_steps") for m in ms]
        for k, v in percentiles(steps, ps).items():
            s[f"{name}_steps_{k}"] = v
    # vLLM's serving metrics in the run's clock (named by "clock"): simulated
    # seconds when a cost model times the steps, else the wall clock. A real
    # model timed by the simulator too also gets its wall-clock ones, "wall_"-prefixed.
    done = [r for r in requests if r.token_steps]
    s["clock"] = clock = "sim" if engine.cost_model is not None else "wall"
    if done:
        s.update(serving_metrics(timings_from_trace(done, trace, clock), ps=ps, goodput=goodput))
        if clock == "sim" and engine.model is not None:
            wall = serving_metrics(timings_from_trace(done, trace, "wall"), ps=ps, goodput=goodput)
            s.update({f"wall_{k}": v for k, v in wall.items()})
    return s


def group_summary(engine: Engine, requests, groups, slos) -> dict:
    """Per class (or client): latency percentiles, tokens served and SLO attainment.

    ``groups[i]`` names request ``i``'s class; ``slos[i]`` is its (TTFT, E2E)
    target in seconds (None: no target). A request *attains* its SLO when it
    finished and both its TTFT and its end-to-end latency are within their
    targets; attainment is the share of the class's requests that do. Seconds
    are in the run's clock: simulated with a cost model, else wall.
    """
    clock = "sim" if engine.cost_model is not None else "wall"
    seconds = {id(r): request_metrics(r, engine.trace).seconds[clock] for r in requests if r.token_steps}

    def attains(r, slo) -> bool:
        s = seconds.get(id(r))
        return r.is_finished and s is not None and all(
            target is None or v <= target for v, target in ((s["ttft"], slo[0]), (s["e2e"], slo[1])))

    out: dict[str, dict] = {}
    for name in dict.fromkeys(groups):
        members = [(r, slo) for r, g, slo in zip(requests, groups, slos) if g == name]
        ttft = [seconds[id(r)]["ttft"] for r, _ in members if id(r) in seconds]
        e2e = [seconds[id(r)]["e2e"] for r, _ in members if id(r) in seconds]
        met = sum(attains(r, slo) for r, slo in members)
        slo = members[0][1]
        g = {"requests": len(members), "finished": sum(r.is_finished for r, _ in members),
             "prompt_tokens": sum(r.num_prompt_tokens for r, _ in members if r.first_scheduled_step is not None),
             "output_tokens": sum(r.num_output_tokens for r, _ in members),
             "preempted": sum(r.num_preemptions for r, _ in members),
             "slo_ttft_s": slo[0], "slo_e2e_s": slo[1], "slo_attainment": met / len(members)}
        g["tokens_served"] = g["prompt_tokens"] + g["output_tokens"]
        for metric, vals in (("ttft", ttft), ("e2e", e2e)):
            for k, v in percentiles(vals, (50, 99)).items():
                g[f"{metric}_{k}_s"] = v
        out[name] = g
    return out


def cpu_name() -> str:
    """The CPU's model name (from ``/proc/cpuinfo`` where there is one), for the
    provenance line of a benchmark."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def warmup(model, steps: int = 4) -> None:
    """A few throwaway steps so first-call costs do not land in a timed run."""
    from ..sampling.params import SamplingParams
    eng = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=64, kv_layout="reserved",
                                     max_num_batched_tokens=None))
    for i in range(2):
        eng.add_request([1] * 16, SamplingParams(max_tokens=steps, ignore_eos=True))
    eng.run()


def run_bench(scheduler: str = "continuous", workload: str = "uniform", num_requests: int = 64,
              max_batch: int = 256, seed: int = 0, model="tiny", sim_gpu: str | None = None,
              sim_model: str | None = None, max_model_len: int | None = None,
              arrival_rate: float | None = None, burstiness: float = 1.0, device: str = "auto",
              dtype: str = "float32", progress: bool = True, simulate_only: bool = False,
              percentiles=DEFAULT_PERCENTILES, goodput=None, speculative_method: str | None = None,
              num_speculative_tokens: int = 3, draft_model=None, sim_acceptance_rate: float = 0.7,
              clients: dict | None = None, slo_ttft_ms: float | None = None,
              slo_e2e_ms: float | None = None, quantization: str | None = None,
              **engine_options) -> tuple[dict, Engine]:
    """Run a workload and return (summary dict, engine). ``simulate_only`` runs no
    model at all (``sim_gpu`` and ``sim_model`` required). ``speculative_method``
    (``"ngram"`` or ``"draft_model"``, with ``draft_model``) turns on speculative
    decoding with ``num_speculative_tokens`` proposals; the simulator accepts
    each with probability ``sim_acceptance_rate``. ``engine_options`` are
    further :class:`EngineConfig` fields (``kv_layout``, ``kv_budget_bytes``,
    ``block_size``, ``max_num_batched_tokens``, ``preemption_mode``, ``policy``,
    ``priority_aging_s``, ...).
    ``quantization``: the real model's weights (``"int8"``, ``"int8_weight_only"``).
    ``percentiles`` and ``goodput`` (SLOs in ms, ``{"ttft": 200}`` or
    ``["ttft:200"]``) shape the latency keys (:func:`summarize`).

    A class workload (``"mixed-classes"``) adds ``summary["per_class"]``, a
    multi-tenant one (``clients``: name -> requests/s) ``summary["per_client"]``
    (see :func:`group_summary`). SLO targets are the class's own (or
    :data:`~minibatch_engine.harness.workload.DEFAULT_SLO_TTFT_S` /
    :data:`~minibatch_engine.harness.workload.DEFAULT_SLO_E2E_S` for tenants);
    ``slo_ttft_ms`` / ``slo_e2e_ms`` replace them for every request."""
    ps = parse_percentiles(percentiles)
    goodput = parse_goodput(goodput)
    if speculative_method is not None:
        from ..speculative.config import SpeculativeConfig
        engine_options["speculative"] = SpeculativeConfig(
            speculative_method, num_speculative_tokens, sim_acceptance_rate=sim_acceptance_rate,
            draft_model=None if simulate_only or speculative_method != "draft_model" else (draft_model or "tiny"))
    cfg = EngineConfig().with_overrides(scheduler=scheduler, max_num_seqs=max_batch, max_model_len=max_model_len,
                                        sim_gpu=sim_gpu, sim_model=sim_model, **engine_options)
    if simulate_only:
        m, vocab = None, 256
    else:
        from ..model.registry import resolve_model
        m = resolve_model(model, device=device, dtype=dtype, quantization=quantization)
        cfg.resolve(m.config)           # refuse a bad configuration before the warm-up
        vocab = min(256, m.config.vocab_size)
        warmup(m)
    engine = Engine(m, cfg)
    specs = make_workload(workload, num_requests, seed=seed, vocab_size=vocab, arrival_rate=arrival_rate,
                          burstiness=burstiness, clients=clients, max_model_len=engine.max_model_len)
    reqs = [engine.add_request(s.prompt_token_ids, s.sampling_params(), arrival_time=s.arrival_time,
                               priority=s.priority, client_id=s.client_id)
            for s in specs]
    with tqdm(total=len(reqs), desc=f"{'simulate' if simulate_only else 'bench'} {scheduler}",
              unit="req", disable=not progress, leave=False) as bar:
        engine.run(progress=bar.update)
    summary = {"scheduler": scheduler, "workload": str(workload), "num_requests": len(specs),
               "arrival_rate": arrival_rate, "burstiness": burstiness,
               "max_batch": max_batch, "seed": seed, "sim_gpu": sim_gpu,
               "sim_model": sim_model if sim_gpu else None,
               "model": None if m is None else (model if isinstance(model, str) else m.config.name),
               "policy": engine.config.policy, "priority_aging_s": engine.config.priority_aging_s,
               "clients": clients}
    summary.update(summarize(engine, reqs, ps=ps, goodput=goodput))
    key, groups = (("per_client", [s.client_id for s in specs]) if clients else
                   ("per_class", [s.request_class for s in specs]) if specs[0].request_class else (None, None))
    if key:
        slos = [slo_of(s, workload) for s in specs]
        slos = [(t if slo_ttft_ms is None else slo_ttft_ms / 1e3, e if slo_e2e_ms is None else slo_e2e_ms / 1e3)
                for t, e in slos]
        summary[key] = group_summary(engine, reqs, groups, slos)
    return summary, engine


def _fmt(v, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}{unit}"
    if abs(v) >= 100:
        return f"{v:,.0f}{unit}"
    return f"{v:.3g}{unit}"


def _bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def _draft_kv_line(s: dict) -> str:
    """The draft model's share of the KV budget (the simulator only sets bytes aside)."""
    where = f"in {_fmt(s['draft_kv_blocks'])} blocks" if s.get("draft_kv_blocks") else "set aside"
    return f"{_bytes(s['draft_kv_bytes'])} {where}, of a {_bytes(s.get('kv_budget_bytes'))} budget"


def _goodput_row(s: dict) -> list:
    if "goodput" not in s:
        return []
    slos = ", ".join(f"{k} <= {s['slo_' + k + '_ms']:g} ms" for k in SLO_METRICS if f"slo_{k}_ms" in s)
    return [(f"goodput ({slos})",
             f"{_fmt(s['goodput'])} requests/s ({_fmt(s['good_requests'])} of {_fmt(s['completed'])})")]


def _kv_dtype_note(s) -> str:
    """``", fp8: 1,088 bytes per token"`` for a quantized cache (nothing for "auto")."""
    dtype = s.get("kv_cache_dtype", "auto")
    return "" if dtype == "auto" else f", {dtype}: {s.get('kv_bytes_per_token'):,} bytes per token"


def format_report(summary: dict, simulated: bool = False) -> str:
    """The summary as a short grouped table a person reads (every key is in the
    JSON). Latencies name their clock: simulated seconds, or wall seconds."""
    s = summary
    if s.get("endpoint"):
        return _table(_endpoint_groups(s))
    clock = "sim_seconds" if simulated or s.get("sim_seconds") is not None else "seconds"
    pk = [k[len("ttft_ms_"):] for k in s if k.startswith("ttft_ms_p")]
    clock_name = f"simulated {s.get('sim_gpu')}" if clock == "sim_seconds" else "wall clock"
    tput = s.get("sim_output_tokens_per_second") if clock == "sim_seconds" else s.get("output_tokens_per_second")
    model = str(s.get("sim_model") if simulated else s.get("model"))
    if s.get("sim_gpu") and not simulated:       # the model runs here; the simulator prices its steps
        model += f" (run here; its steps priced as {s.get('sim_model') or model} on a simulated {s['sim_gpu']})"
    par = s.get("sim_parallelism")
    if par and par["gpus"] > 1:                 # e.g. "on 16 GPUs: TP 8 x PP 2"
        model += f" on {par['gpus']} GPUs: " + " x ".join(
            f"{k} {par[v]}" for k, v in (("TP", "tensor"), ("PP", "pipeline"), ("EP", "expert")) if par[v] > 1)
    groups = [
        ("workload", [
            ("model", model), ("workload", f"{s['workload']}, {s['num_requests']} requests, seed {s['seed']}"),
            ("scheduler", f"{s['scheduler']}, max {s['max_batch']} sequences, token budget "
                          f"{_fmt(s.get('max_num_batched_tokens'))}"
                          f"{', chunked prefill' if s.get('chunked_prefill') else ''}"),
            ("finished", f"{_fmt(s['finished_requests'])} requests, {_fmt(s['output_tokens'])} output tokens, "
                         f"{_fmt(s['steps'])} steps")]),
        (f"throughput ({clock_name})", [
            ("output tokens/s", _fmt(tput)),
            ("requests/s", _rate_line(s)),
            *_goodput_row(s),
            ("batch efficiency η", _fmt(s.get("eta"))),
            ("mean batch utilization", _fmt(s.get("batch_utilization")))]),
        (f"latency ({clock_name}, ms, {' / '.join(pk)})", [
            (name, " / ".join(_fmt(s.get(f"{key}_ms_{p}")) for p in pk))
            for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2EL", "e2el"))]),
        ("KV memory", [
            ("cache", f"{s['kv_layout']}, {_bytes(s.get('kv_capacity_bytes'))} in {_fmt(s.get('kv_blocks'))} "
                      f"{'rows' if s['kv_layout'] == 'reserved' else 'blocks'}"
                      + _kv_dtype_note(s)),
            *([("draft model's cache", _draft_kv_line(s))] if "draft_kv_bytes" in s else []),
            ("allocated bytes in use (mean)", _fmt(s.get("kv_utilization"))),
            ("prefix-cache hits", f"{_fmt(s.get('prefix_cache_hit_tokens'))} tokens")]),
        ("speculative decoding", [
            ("method", f"{s.get('speculative_method')}, k = {s.get('num_speculative_tokens')}"),
            ("acceptance rate", _fmt(s.get("acceptance_rate"))),
            ("accepted per verification", _fmt(s.get("mean_accepted_per_verification"))),
            ("draft time share", _fmt(s.get("sim_draft_time_fraction" if simulated else "draft_time_fraction")))]),
        ("preemption", [
            ("preemptions", _fmt(s.get("preemptions"))),
            ("recomputed tokens", _fmt(s.get("recomputed_tokens"))),
            ("swapped", _bytes(s.get("swapped_bytes")))]),
    ]
    if not s.get("speculative_method"):
        groups = [g for g in groups if g[0] != "speculative decoding"]
    if not simulated and np.isfinite(s.get("overhead_fraction", float("nan"))):
        groups[1][1].append(("engine overhead", f"{s['overhead_fraction']:.1%} of step time"))
    if not simulated and s.get("machine_limit_fraction") is not None:
        groups[1][1].append(("of this CPU's limit", _limit_line(s)))
    if s.get("policy", "fcfs") != "fcfs":
        aging = s.get("priority_aging_s")
        groups[0][1].append(("policy", s["policy"] + (f", aging {_fmt(aging)} s" if aging else "")))
    per = s.get("per_class") or s.get("per_client")
    if per:
        title = f"per {'class' if 'per_class' in s else 'client'} ({clock_name}; TTFT, E2E p50 / p99)"
        groups.append((title, [(name, _group_line(g)) for name, g in per.items()]))
    return _table(groups)


def _table(groups) -> str:
    width = max(len(k) for _, rows in groups for k, _ in rows)
    lines = []
    for title, rows in groups:
        lines.append(title)
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _latency_rows(s: dict) -> list:
    pk = [k[len("ttft_ms_"):] for k in s if k.startswith("ttft_ms_p")]
    return [(name, " / ".join(_fmt(s.get(f"{key}_ms_{p}")) for p in pk))
            for name, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2EL", "e2el"))]


def _endpoint_groups(s: dict) -> list:
    """The report of a run against a server (``bench --endpoint``): what a client can see."""
    pk = [k[len("ttft_ms_"):] for k in s if k.startswith("ttft_ms_p")]
    rate = "all at time 0" if s.get("arrival_rate") is None else f"{_fmt(s['arrival_rate'])} requests/s"
    finished = f"{_fmt(s['finished_requests'])} requests, {_fmt(s['output_tokens'])} output tokens"
    if s.get("failed_requests"):
        finished += f", {s['failed_requests']} failed ({s.get('first_error')})"
    groups = [
        ("workload", [("endpoint", f"{s['endpoint']} (model {s['model']})"),
                      ("workload", f"{s['workload']}, {s['num_requests']} requests, seed {s['seed']}, "
                                   f"arrivals {rate}"),
                      ("finished", finished)]),
        ("throughput (wall clock, as the client saw it)", [
            ("output tokens/s", _fmt(s.get("output_throughput"))),
            ("requests/s", _fmt(s.get("request_throughput"))), *_goodput_row(s)]),
        (f"latency (wall clock, ms, {' / '.join(pk)})", _latency_rows(s))]
    server = [(name, _fmt(int(s[k]))) for name, k in (
        ("preemptions", "server_num_preemptions_total"), ("prompt tokens", "server_prompt_tokens_total"),
        ("generation tokens", "server_generation_tokens_total")) if k in s]
    if server:
        groups.append(("the server's own counters (/metrics), during the run", server))
    return groups


def _rate_line(s: dict) -> str:
    """Completed requests per second, said as such: below an offered rate, since
    the run's span includes the last requests' decoding after the arrivals end."""
    line = f"{_fmt(s.get('request_throughput'))} completed"
    if s.get("arrival_rate") is not None:
        line += f" (offered {_fmt(s['arrival_rate'])}/s; the span includes draining the last requests)"
    return line


def _limit_line(s: dict) -> str:
    """"x% of this CPU's limit": the run's steps at the machine's measured rates,
    over their wall time, and where the rates came from (the provenance says
    whether they were re-measured, or raised to a run that beat them). No share
    above 100% is printed: a summary from before that rule shows 100%, saying so."""
    frac, large = s["machine_limit_fraction"], s.get("machine_large_batch_limit_fraction")
    large = None if large is None or not np.isfinite(large) else large
    beat = max(frac, large or 0.0) > 1 and not s.get("machine_limit_raised_to_run")
    frac, large = min(frac, 1.0), (None if large is None else min(large, 1.0))
    line = (f"{frac:.0%} (steps of 32+ rows: {'n/a' if large is None else f'{large:.0%}'}; its matmuls "
            f"{s['machine_matmul_flops_per_s'] / 1e9:,.0f} GFLOP/s, memory {s['machine_memory_bytes_per_s'] / 1e9:,.0f} "
            f"GB/s: {s.get('machine_limit_provenance', 'measured once')})")
    if beat:                    # (the provenance says it when run_against_limit raised the limit)
        line += "; this run beat the measured limit; the limit is taken as at least this run's rate"
    return line


def _group_line(g: dict) -> str:
    ms = lambda k: _fmt(None if g.get(k) is None else g[k] * 1e3)   # noqa: E731
    slo = " & ".join(f"{name} <= {_fmt(g[k] * 1e3)} ms" for name, k in (("TTFT", "slo_ttft_s"), ("E2E", "slo_e2e_s"))
                     if g.get(k) is not None)
    return (f"{g['requests']} req, TTFT {ms('ttft_p50_s')} / {ms('ttft_p99_s')} ms, "
            f"E2E {ms('e2e_p50_s')} / {ms('e2e_p99_s')} ms, {_fmt(g['tokens_served'])} tokens, "
            f"SLO ({slo}) {g['slo_attainment']:.0%}")


def write_json(summary: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(summary, f, indent=2, sort_keys=False)
        f.write("\n")
