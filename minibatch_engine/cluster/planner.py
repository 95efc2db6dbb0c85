"""A deployment planner: the fewest GPUs that serve a workload at a rate within an SLO.

A deployment is ``replicas`` copies of one engine, each on ``tp x pp`` GPUs
(tensor x pipeline parallelism), with a chunked-prefill token budget, behind
a router. The planner searches those four numbers for the fewest GPUs whose
simulated run meets a latency SLO at a percentile: TTFT and TPOT both, as
DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al., ISCA 2024)
size their deployments. Every candidate is simulated whole, as a
:class:`~.replicas.Cluster`: the replicas share one arrival stream, in time
order, and the router sends each request where the load is at that moment.
Splitting the rate into ``replicas`` independent streams would be exact for a
round-robin router only, and it would smooth the trace's bursts, which hit
every replica at once.

The search is pruned in three ways, none of which can drop a better plan:

* memory: a ``tp x pp`` whose share of the weights does not fit a GPU, or
  leaves no room for the KV cache of the longest request, is skipped with the
  reason;
* latency floors: each request's TTFT is at least its prompt's prefill on an
  idle replica, and its TPOT at least a batch-of-one decode step; when the
  floors' percentile already misses the SLO, no number of replicas helps;
* replicas: a capacity estimate from the cost model (each request's prefill
  and decode work at the largest batch its KV memory holds) gives a first
  guess; the search walks down from it while the SLO holds and gallops up
  while it does not, then bisects. Once a plan is found, every other
  configuration is searched below its GPU count only. (More replicas never
  hurt an SLO in this search's model: that is the one assumption.)

And a simulation stops as soon as enough requests have missed the TTFT SLO to
settle the percentile, so an overloaded candidate costs little.

Pipeline parallelism's stages (:data:`DEFAULT_PP_SIZES`) are priced by the
simulator's pipeline model (:mod:`minibatch_engine.sim.pipeline`): they add
memory and hand-overs, not speed per token.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from ..core.engine import Engine
from ..harness.metrics import serving_metrics, timings_from_trace
from ..harness.request_traces import TRACE_FILES, TraceWorkload, load_trace
from ..harness.utilization import utilization
from ..harness.workload import make_workload, workload_names
from ..model.config import get_preset
from ..sim.cost_model import CostModel
from ..sim.hardware import get_gpu
from ..sim.operators import check_tensor_parallel
from .pricing import cost_per_million_tokens, gpu_hour_price
from .replicas import Cluster
from .router import make_router

DEFAULT_TP_SIZES = (1, 2, 4, 8)        # one NVLink node (past it, the all-reduce is extrapolated)
DEFAULT_PP_SIZES = (1, 2, 4)
DEFAULT_BUDGETS = (512, 2048, 8192)    # chunked-prefill token budgets: short steps (TPOT) to long (TTFT)
DEFAULT_PERCENTILE = 90.0              # DistServe's 90% SLO attainment; p99 of a few hundred requests is a handful
DEFAULT_NUM_REQUESTS = 300
DEFAULT_MAX_GPUS = 64
DEFAULT_ROUTER = "least-requests"
GPU_MEMORY_UTILIZATION = 0.9           # the engine's default share of each GPU's memory


@dataclass(frozen=True)
class Deployment:
    """``replicas`` engines of ``tp x pp`` GPUs each, with a token budget per step."""
    tp: int
    pp: int
    replicas: int
    budget: int

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica


@dataclass
class Candidate:
    """One simulated deployment: its latencies at the plan's percentile (ms),
    throughputs, whether it meets the SLO, and ``headroom``: the larger of
    TTFT / TTFT SLO and TPOT / TPOT SLO (meets the SLO when <= 1). ``mfu`` and
    ``mbu`` are filled for the chosen plan; ``cost_per_mtok`` in USD per million
    output tokens at the offered load (``cost_per_mtok_total``: per million
    prompt and output tokens, the fairer unit for prefill-heavy traffic such as
    code completion). ``stopped``: the run was cut short once
    enough requests had missed the TTFT SLO to settle the percentile; its
    ``ttft_ms`` is then a lower bound and the rest NaN."""
    deployment: Deployment
    ttft_ms: float
    tpot_ms: float
    output_throughput: float
    request_throughput: float
    meets_slo: bool
    headroom: float
    cost_per_mtok: float
    cost_per_mtok_total: float
    mfu: float | None = None
    mbu: float | None = None
    stopped: bool = False

    def row(self) -> dict:
        """Flat keys, for JSON and tables."""
        d = asdict(self)
        d.update(d.pop("deployment"), gpus=self.deployment.gpus)
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}


@dataclass(frozen=True)
class Skipped:
    """A ``tp x pp`` (and budget, or None for all of them) the planner did not simulate, and why."""
    tp: int
    pp: int
    budget: int | None
    reason: str


@dataclass
class Plan:
    """The planner's answer: ``chosen`` (None when nothing meets the SLO),
    ``candidates`` (each configuration's fewest-GPU result, best first),
    ``skipped`` (with reasons), ``settings`` (what was asked), ``simulations``
    run and the search's wall ``seconds``."""
    chosen: Candidate | None
    candidates: list[Candidate]
    skipped: list[Skipped]
    settings: dict
    simulations: int
    seconds: float

    @property
    def closest(self) -> Candidate | None:
        """The candidate nearest the SLO (the smallest headroom), feasible or not."""
        return min(self.candidates, key=lambda c: (c.headroom, c.deployment.gpus), default=None)

    def to_dict(self) -> dict:
        """Everything as plain JSON-able data."""
        return {"settings": self.settings, "chosen": self.chosen.row() if self.chosen else None,
                "candidates": [c.row() for c in self.candidates], "skipped": [asdict(s) for s in self.skipped],
                "simulations": self.simulations, "seconds": self.seconds}


class NoPlanError(ValueError):
    """No deployment within the search meets the SLO; ``plan`` holds what was tried."""

    def __init__(self, message: str, plan: Plan):
        super().__init__(message)
        self.plan = plan


@dataclass
class _Search:
    """The fixed parts of one planning problem."""
    model: str
    gpu: str
    specs: list
    max_model_len: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    percentile: float
    router: str
    max_batch: int
    usd_per_gpu_hour: float
    offered_output_tps: float
    offered_total_tps: float
    simulations: int = 0
    check_every: int = 512                            # cluster events between checks for a settled miss
    cache: dict = field(default_factory=dict)
    clusters: dict = field(default_factory=dict)     # deployments that met the SLO -> their cluster

    def engine_options(self, d: Deployment) -> dict:
        return dict(tensor_parallel_size=d.tp, pipeline_parallel_size=d.pp, max_num_batched_tokens=d.budget)

    def engines(self, d: Deployment) -> list[Engine]:
        return [Engine(None, sim_gpu=self.gpu, sim_model=self.model, max_num_seqs=self.max_batch,
                       max_model_len=self.max_model_len, **self.engine_options(d)) for _ in range(d.replicas)]

    def run(self, d: Deployment) -> tuple[Candidate, Cluster]:
        """Simulate ``d`` on the workload: a cluster of its replicas behind the router."""
        self.simulations += 1
        cluster = Cluster({"all": (self.engines(d), make_router(self.router))})
        for i, s in enumerate(self.specs):
            cluster.submit(s.prompt_token_ids, s.sampling_params(), s.arrival_time, f"req-{i}")
        threshold = len(self.specs) - math.floor(self.percentile / 100 * (len(self.specs) - 1))
        events = 0
        while cluster.step():
            events += 1
            if events % self.check_every == 0:
                lower = self.ttft_lower_bounds_ms(cluster)
                if np.count_nonzero(lower > self.slo_ttft_ms) >= threshold:
                    return self.stopped(d, lower), cluster
        timings = [t for r in cluster.replicas
                   for t in timings_from_trace(r.engine.requests.values(), r.engine.trace, "sim")]
        if len(timings) != len(self.specs):
            raise RuntimeError(f"{d}: {len(timings)} of {len(self.specs)} requests finished")
        cluster.timings = timings
        m = serving_metrics(timings, ps=(self.percentile,))
        key = f"{self.percentile:g}"
        ttft, tpot = m[f"ttft_ms_p{key}"], m[f"tpot_ms_p{key}"]
        headroom = max(ttft / self.slo_ttft_ms, tpot / self.slo_tpot_ms)
        return Candidate(d, ttft, tpot, m["output_throughput"], m["request_throughput"], headroom <= 1, headroom,
                         *self.costs(d)), cluster

    def costs(self, d: Deployment) -> tuple[float, float]:
        """USD per million output tokens, and per million prompt and output tokens, at the offered load."""
        return (cost_per_million_tokens(d.gpus, self.usd_per_gpu_hour, self.offered_output_tps),
                cost_per_million_tokens(d.gpus, self.usd_per_gpu_hour, self.offered_total_tps))

    def ttft_lower_bounds_ms(self, cluster: Cluster) -> np.ndarray:
        """Each request's TTFT so far (ms): its own once its first token is out,
        else the time it has waited on its replica's clock (0 before it arrives)."""
        out = []
        for r in cluster.replicas:
            e = r.engine
            for req in e.requests.values():
                a = req.arrival_time.get("sim")
                if a is not None:
                    first = e.trace[req.token_steps[0]].sim_end if req.token_steps else e.sim_now
                    out.append(max(0.0, first - a) * 1e3)
        return np.array(out + [0.0] * (len(self.specs) - len(out)))

    def stopped(self, d: Deployment, lower_ms: np.ndarray) -> Candidate:
        """A run cut short: so many requests missed the TTFT SLO that the
        percentile misses it whatever the rest do. (Percentiles interpolate
        between order statistics: once the top ``N - floor(p (N - 1) / 100)``
        values exceed the SLO, so does the p-th percentile.)"""
        ttft = _percentile(lower_ms, self.percentile)
        nan = float("nan")
        return Candidate(d, ttft, nan, nan, nan, False, ttft / self.slo_ttft_ms, *self.costs(d), stopped=True)

    def candidate(self, d: Deployment) -> Candidate:
        if d not in self.cache:
            self.cache[d], cluster = self.run(d)
            if self.cache[d].meets_slo:
                self.clusters[d] = cluster
        return self.cache[d]

    def keep_clusters(self, at_most_gpus: int) -> None:
        """Let go of the clusters of deployments with more GPUs than ``at_most_gpus``."""
        self.clusters = {d: c for d, c in self.clusters.items() if d.gpus <= at_most_gpus}


def _workload_specs(workload: str, rate: float, num_requests: int, seed: int, trace_start: float,
                    trace_duration: float | None, max_position: int) -> tuple[list, str, bool]:
    """The requests to replay at ``rate``: a trace window's first ``num_requests``
    with arrivals scaled to that mean rate (clipped to the model's context), or
    a synthetic workload's with Poisson arrivals. Returns (specs, label, clipped)."""
    if workload in TRACE_FILES or workload.endswith(".csv"):
        trace = load_trace(workload).window(trace_start, trace_duration)
        if num_requests < len(trace):                  # end the window at the next request's arrival
            trace = trace.window(0.0, float(trace.arrivals[num_requests]))
        clipped = bool(np.any(trace.prompt_lens + trace.output_lens > max_position))
        wl = TraceWorkload(trace, time_scale=rate / trace.rate, clip=True, max_model_len=max_position)
        return wl.make_requests(seed=seed), str(wl), clipped
    if workload not in workload_names():
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(list(TRACE_FILES) + workload_names())} "
                         "or a trace CSV path")
    specs = make_workload(workload, num_requests, seed=seed, arrival_rate=rate)
    return specs, f"{workload} (Poisson, {rate:g} req/s)", False


def _fit_reason(model, gpu, tp: int, pp: int, kv_bytes_longest: float) -> str | None:
    """Why ``tp x pp`` GPUs cannot hold ``model`` (its weights, then the longest
    request's KV cache), or None when they can: the cost model's own split of
    the weights over the stages (the fullest GPU) and the KV room it leaves."""
    try:
        cm = CostModel(gpu, model, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    except ValueError as e:
        return str(e)
    usable = GPU_MEMORY_UTILIZATION * gpu.memory_bytes
    share = cm.weight_bytes_per_gpu
    if share > usable:
        return (f"weights do not fit: {cm.weight_bytes / 1e9:.0f} GB over {tp * pp} GPUs is {share / 1e9:.1f} GB "
                f"on the fullest, more than the {usable / 1e9:.1f} GB usable on a {gpu.name}")
    kv_room = cm.kv_memory_bytes(usable)
    if kv_bytes_longest * cm.kv_replication > kv_room:
        return (f"no room for the KV cache: {kv_room / 1e9:.1f} GB left after the weights, the longest request "
                f"needs {kv_bytes_longest * cm.kv_replication / 1e9:.1f} GB")
    return None


def _percentile(values, p: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), p))


def _floors_ms(engine: Engine, specs, budget: int, p: float) -> tuple[float, float]:
    """The ``p``-th percentile of each request's TTFT and TPOT on an idle replica
    (its prefill in chunks of ``budget``; one decode step at its prompt's
    length): no load can beat them."""
    cm = engine.cost_model
    ttft, tpot = [], []
    for s in specs:
        n, done, t = len(s.prompt_token_ids), 0, 0.0
        while done < n:
            q = min(budget, n - done)
            done += q
            t += cm.step_time([(q, done)])
        ttft.append(t)
        tpot.append(cm.step_time([(1, n + 1)]))
    return _percentile(ttft, p) * 1e3, _percentile(tpot, p) * 1e3


def _replicas_guess(engine: Engine, specs, rate: float, budget: int) -> int:
    """Replicas a rate needs by the cost model: each request's prefill (in
    budget-sized steps) and decode (at the largest batch the KV memory and
    max_num_seqs allow, each sequence at its mean context) as a share of one
    replica's seconds; load = rate x mean seconds per request."""
    cm, cfg = engine.cost_model, engine.config
    prompts = np.array([len(s.prompt_token_ids) for s in specs])
    outputs = np.array([s.max_tokens for s in specs])
    context = int(np.mean(prompts + outputs / 2))
    kv_tokens = engine.kv_cache.num_blocks * engine.kv_cache.block_size
    batch = max(1, min(cfg.max_num_seqs, kv_tokens // int(np.mean(prompts + outputs))))
    prefill_s_per_token = cm.step_time([(budget, budget)]) / budget
    decode_s_per_token = cm.step_time([(1, context)] * batch) / batch
    per_request = float(np.mean(prompts) * prefill_s_per_token + np.mean(outputs) * decode_s_per_token)
    return max(1, math.ceil(rate * per_request))


def _fewest_replicas(search: _Search, tp: int, pp: int, budget: int, guess: int, most: int) -> Candidate | None:
    """The fewest replicas (1..``most``) of ``tp x pp`` with ``budget`` that meet
    the SLO, searched from ``guess`` (assuming more replicas never miss it when
    fewer meet it); its candidate, or the last one tried when none in range meets it."""
    def ok(n):
        return search.candidate(Deployment(tp, pp, n, budget)).meets_slo
    guess = min(max(1, guess), most)
    if ok(guess):
        hi, step, lo = guess, 1, guess - 1
        while lo >= 1 and ok(lo):
            hi, step = lo, step * 2
            lo = hi - step
        lo = max(lo, 0)
    else:
        lo, step = guess, 1
        while True:
            hi = min(lo + step, most)
            if hi == lo:
                return search.candidate(Deployment(tp, pp, lo, budget))   # none in range: the closest tried
            if ok(hi):
                break
            lo, step = hi, step * 2
    while hi - lo > 1:                                  # lo misses (or is 0), hi meets
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return search.candidate(Deployment(tp, pp, hi, budget))


def plan_deployment(model: str, gpu: str, workload: str = "azure-conv", rate: float = 2.0, *,
                    slo_ttft_ms: float = 500.0, slo_tpot_ms: float = 50.0, percentile: float = DEFAULT_PERCENTILE,
                    gpu_hour_usd: float | None = None, tp_sizes: Sequence[int] = DEFAULT_TP_SIZES,
                    pp_sizes: Sequence[int] = DEFAULT_PP_SIZES, budgets: Sequence[int] = DEFAULT_BUDGETS,
                    max_gpus: int = DEFAULT_MAX_GPUS, num_requests: int = DEFAULT_NUM_REQUESTS,
                    trace_start: float = 0.0, trace_duration: float | None = None, seed: int = 0,
                    router: str = DEFAULT_ROUTER, max_batch: int = 256, prune: bool = True,
                    progress: bool = False) -> Plan:
    """Find the deployment of ``model`` (a preset name) on ``gpu`` with the fewest
    GPUs whose simulated run of ``workload`` at ``rate`` requests/s keeps the
    ``percentile``-th TTFT within ``slo_ttft_ms`` and TPOT within ``slo_tpot_ms``.

    It searches tensor parallelism ``tp_sizes`` x pipeline parallelism
    ``pp_sizes`` x token ``budgets`` x
    replicas (up to ``max_gpus`` GPUs in all). ``workload``: a trace
    (``"azure-conv"``, ``"azure-code"``, a CSV path), whose window
    ``[trace_start, trace_start + trace_duration)`` gives its first
    ``num_requests`` requests, their arrivals scaled to ``rate``; or a synthetic
    workload (:func:`~minibatch_engine.harness.workload.workload_names`) with
    Poisson arrivals. ``router``: how requests are spread over replicas
    (:data:`~.router.ROUTER_POLICIES`). ``gpu_hour_usd``: the price of one GPU
    for an hour (default: :data:`~.pricing.GPU_HOUR_USD`). ``prune=False``
    finds every configuration's own fewest replicas (more simulations) instead
    of searching below the best plan's GPU count only (so ``prune=True``
    breaks ties in the order the configurations are tried: by estimated GPUs).

    Returns a :class:`Plan`; the chosen candidate has its MFU and MBU. Ties in
    GPUs (among the deployments simulated) go to the larger SLO headroom. Raises :class:`NoPlanError` (holding the
    plan, whose ``closest`` says how near it came) when nothing meets the SLO,
    and ``ValueError`` for an unknown model, GPU or workload.
    """
    started = time.perf_counter()
    m, g = get_preset(model), get_gpu(gpu)
    price = gpu_hour_price(g.name, gpu_hour_usd)
    for name, v in (("rate", rate), ("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    if not 0 < percentile < 100:
        raise ValueError(f"percentile must be in (0, 100), got {percentile!r}")
    specs, label, clipped = _workload_specs(workload, rate, num_requests, seed, trace_start, trace_duration,
                                            m.max_position)
    longest = max(len(s.prompt_token_ids) + s.max_tokens for s in specs)
    max_model_len = min(m.max_position, -(-longest // 16) * 16)
    out_tokens = sum(s.max_tokens for s in specs)
    span = max(s.arrival_time for s in specs) - min(s.arrival_time for s in specs)
    all_tokens = out_tokens + sum(len(s.prompt_token_ids) for s in specs)
    per_s = 1 / span if span > 0 else rate / len(specs)          # the window's arrival span sets the load
    offered_tps, offered_total_tps = out_tokens * per_s, all_tokens * per_s
    search = _Search(m.name, g.name, specs, max_model_len, slo_ttft_ms, slo_tpot_ms, percentile, router,
                     max_batch, price.usd_per_gpu_hour, offered_tps, offered_total_tps)
    settings = {"model": m.name, "gpu": g.name, "workload": label, "rate": rate, "num_requests": len(specs),
                "clipped_to_context": clipped, "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
                "percentile": percentile, "router": router, "max_gpus": max_gpus, "max_batch": max_batch,
                "max_model_len": max_model_len, "tp_sizes": list(tp_sizes), "pp_sizes": list(pp_sizes),
                "budgets": list(budgets), "usd_per_gpu_hour": price.usd_per_gpu_hour, "price_source": price.source,
                "offered_output_tokens_per_s": offered_tps, "offered_tokens_per_s": offered_total_tps}
    kv_longest = m.kv_bytes_per_token() * longest
    skipped, configs = [], []
    for tp in tp_sizes:
        for pp in pp_sizes:
            reason = _fit_reason(m, g, tp, pp, kv_longest)
            if reason is None and tp * pp > max_gpus:
                reason = f"one replica needs {tp * pp} GPUs, more than max_gpus ({max_gpus})"
            if reason is not None:
                skipped.append(Skipped(tp, pp, None, reason))
                continue
            for budget in budgets:
                probe = search.engines(Deployment(tp, pp, 1, budget))[0]
                ttft0, tpot0 = _floors_ms(probe, specs, budget, percentile)
                if ttft0 > slo_ttft_ms or tpot0 > slo_tpot_ms:
                    skipped.append(Skipped(tp, pp, budget, f"misses the SLO at any replica count: on an idle "
                                           f"replica p{percentile:g} TTFT is {ttft0:.0f} ms and TPOT "
                                           f"{tpot0:.1f} ms"))
                    continue
                configs.append((_replicas_guess(probe, specs, rate, budget) * tp * pp, tp, pp, budget))
    configs.sort()
    best: Candidate | None = None
    candidates = []
    with tqdm(total=len(configs), desc=f"plan {m.name} on {g.name}", unit="config", disable=not progress,
              leave=False) as bar:
        for estimate, tp, pp, budget in configs:
            most = max_gpus // (tp * pp)
            if prune and best is not None:               # only fewer GPUs than the plan found can win
                most = min(most, (best.deployment.gpus - 1) // (tp * pp))
            if most < 1:
                skipped.append(Skipped(tp, pp, budget, f"pruned: one replica ({tp * pp} GPUs) has no fewer GPUs "
                                       f"than the plan found ({best.deployment.gpus})"))
            else:
                c = _fewest_replicas(search, tp, pp, budget, estimate // (tp * pp), most)
                candidates.append(c)
                if c.meets_slo and (best is None or (c.deployment.gpus, c.headroom)
                                    < (best.deployment.gpus, best.headroom)):
                    best = c
                    search.keep_clusters(best.deployment.gpus)
            bar.update()
            bar.set_postfix(sims=search.simulations, best=best.deployment.gpus if best else "-")
    candidates.sort(key=lambda c: (not c.meets_slo, c.deployment.gpus, c.headroom))
    plan = Plan(best, candidates, skipped, settings, search.simulations, 0.0)
    if best is not None:
        _add_utilization(search, best)
    plan.seconds = time.perf_counter() - started
    if best is None:
        raise NoPlanError(_no_plan_message(plan), plan)
    return plan


def _add_utilization(search: _Search, c: Candidate) -> None:
    """Fill the chosen deployment's MFU and MBU over its run."""
    cluster = search.clusters[c.deployment]
    span = max(t.token_times[-1] for t in cluster.timings) - min(t.arrival for t in cluster.timings)
    u = utilization((r.engine for r in cluster.replicas), span, c.deployment.gpus_per_replica)
    c.mfu, c.mbu = u["mfu"], u["mbu"]


def _no_plan_message(plan: Plan) -> str:
    s = plan.settings
    slo = f"p{s['percentile']:g} TTFT <= {s['slo_ttft_ms']:g} ms and TPOT <= {s['slo_tpot_ms']:g} ms"
    head = (f"no deployment of {s['model']} on {s['gpu']} (up to {s['max_gpus']} GPUs) meets {slo} "
            f"at {s['rate']:g} req/s")
    c = plan.closest
    if c is not None:
        d = c.deployment
        reach = (f"TTFT above {c.ttft_ms:.0f} ms" if c.stopped
                 else f"TTFT {c.ttft_ms:.0f} ms and TPOT {c.tpot_ms:.1f} ms")
        return (f"{head}; the closest: {d.gpus} GPUs (TP {d.tp}, PP {d.pp}, {d.replicas} replicas, budget "
                f"{d.budget}) reach {reach}; relax the SLO, lower the rate or raise max_gpus")
    if plan.skipped and all(k.reason.startswith("weights do not fit") for k in plan.skipped):
        m, g = get_preset(s["model"]), get_gpu(s["gpu"])
        need = math.ceil(m.num_parameters() * 2 / (GPU_MEMORY_UTILIZATION * g.memory_bytes))
        return (f"{head}: its weights ({m.num_parameters() * 2 / 1e9:.0f} GB in bf16) need {need} or more "
                f"{g.name}s per replica, more than the sizes tried (TP {s['tp_sizes']} x PP {s['pp_sizes']}); "
                "add pipeline stages across nodes (pp_sizes) or pick a GPU with more memory")
    reasons = "; ".join(f"TP {k.tp} x PP {k.pp}" + (f" budget {k.budget}" if k.budget else "") + f": {k.reason}"
                        for k in plan.skipped[:4])
    return f"{head}: nothing could be simulated ({reasons})"


def format_plan(plan: Plan, rows: int = 10) -> str:
    """The plan as text: the chosen deployment with its cost, MFU and MBU, the
    runner-up table, and the skipped configurations with their reasons."""
    s = plan.settings
    p = f"p{s['percentile']:g}"
    lines = [f"{s['model']} on {s['gpu']}, {s['workload']}, {s['num_requests']} requests; SLO {p} TTFT <= "
             f"{s['slo_ttft_ms']:g} ms, {p} TPOT <= {s['slo_tpot_ms']:g} ms; router {s['router']}"]
    c = plan.chosen
    if c is not None:
        d = c.deployment
        lines.append(f"plan: {d.gpus} GPUs = {d.replicas} replica(s) x TP {d.tp} x PP {d.pp}, token budget "
                     f"{d.budget}: {p} TTFT {c.ttft_ms:.0f} ms, {p} TPOT {c.tpot_ms:.1f} ms, "
                     f"{c.output_throughput:,.0f} output tok/s")
        lines.append(f"cost: ${c.cost_per_mtok:.2f} per million output tokens (${c.cost_per_mtok_total:.2f} per "
                     f"million prompt + output tokens) at ${s['usd_per_gpu_hour']:.2f} per GPU-hour, serving the "
                     f"offered {s['offered_output_tokens_per_s']:,.0f} output tok/s; MFU {c.mfu:.1%}, MBU "
                     f"{c.mbu:.1%} over the run")
    header = (f"{'GPUs':>5} {'TP':>3} {'PP':>3} {'repl':>5} {'budget':>6} {p + ' TTFT ms':>12} "
              f"{p + ' TPOT ms':>12} {'out tok/s':>10} {'$/Mtok':>7} {'meets SLO':>9}")
    lines += ["", header]
    for k in plan.candidates[:rows]:
        d = k.deployment
        ttft = f">{k.ttft_ms:,.0f}" if k.stopped else f"{k.ttft_ms:,.0f}"
        tpot, tput = ("-", "-") if k.stopped else (f"{k.tpot_ms:,.1f}", f"{k.output_throughput:,.0f}")
        lines.append(f"{d.gpus:>5} {d.tp:>3} {d.pp:>3} {d.replicas:>5} {d.budget:>6} {ttft:>12} {tpot:>12} "
                     f"{tput:>10} {k.cost_per_mtok:>7.2f} {'yes' if k.meets_slo else 'no':>9}")
    for k in plan.skipped:
        budget = f", budget {k.budget}" if k.budget is not None else ""
        lines.append(f"skipped TP {k.tp} x PP {k.pp}{budget}: {k.reason}")
    if s["clipped_to_context"]:
        lines.append(f"note: requests longer than {s['model']}'s context were clipped to it")
    if any(k.stopped for k in plan.candidates[:rows]):
        lines.append(f"'>': the run stopped once enough requests had missed the TTFT SLO to settle its {p}")
    lines.append(f"{plan.simulations} simulations in {plan.seconds:.1f} s; price: {s['price_source']}")
    return "\n".join(lines)
