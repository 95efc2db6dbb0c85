"""Co-located serving across replicas: every replica prefills and decodes its
own requests (chunked prefill, by the engine's defaults); a router spreads the
requests. ``simulate --replicas N --router POLICY``."""
from __future__ import annotations

from tqdm.auto import tqdm

from ..harness.metrics import DEFAULT_PERCENTILES, parse_goodput, parse_percentiles, timings_from_trace
from ..harness.workload import make_workload
from .replicas import Cluster, sim_engines
from .router import make_router
from .summary import replica_summary, totals


def simulate_cluster(replicas: int = 2, router: str = "round-robin", workload: str = "multi-turn",
                     num_requests: int = 200, arrival_rate: float | None = 4.0, burstiness: float = 1.0,
                     seed: int = 0, sim_gpu: str = "H100-SXM", sim_model: str = "llama-3-8b",
                     max_batch: int = 256, prefix_source: str = "router", max_imbalance: int | None = 8,
                     percentiles=DEFAULT_PERCENTILES, goodput=None, progress: bool = False,
                     specs=None, **engine_options) -> tuple[dict, Cluster]:
    """Run a seeded workload on ``replicas`` simulated engines behind a ``router``
    policy (:data:`~.router.ROUTER_POLICIES`; ``max_imbalance`` is the prefix
    policy's load guard). Returns (summary, cluster): the summary holds the
    run's settings, ``per_replica`` rows and the totals of :func:`~.summary.totals`
    (vLLM's keys over every request, ``steady_*``, ``prefix_hit_rate``,
    ``load_imbalance``, per-GPU rates). ``engine_options``: each replica's
    :class:`~minibatch_engine.config.EngineConfig` fields (``kv_budget_bytes``,
    ``tensor_parallel_size``, ...). ``specs``: the requests to run
    (:class:`~minibatch_engine.harness.workload.RequestSpec`, as a live run sent
    them) instead of drawing ``num_requests`` from ``workload``."""
    ps, slo = parse_percentiles(percentiles), parse_goodput(goodput)
    policy = make_router(router, **({"max_imbalance": max_imbalance} if router == "prefix" else {}))
    engines = sim_engines(replicas, sim_gpu, sim_model, max_batch, **engine_options)
    cluster = Cluster({"all": (engines, policy)}, prefix_source=prefix_source)
    if specs is None:
        specs = make_workload(workload, num_requests, seed=seed, vocab_size=256, arrival_rate=arrival_rate,
                              burstiness=burstiness)
    else:
        num_requests = len(specs)
    for i, s in enumerate(specs):
        cluster.submit(s.prompt_token_ids, s.sampling_params(), s.arrival_time, f"req-{i}")
    with tqdm(total=len(specs), desc=f"cluster {router}", unit="req", disable=not progress, leave=False) as bar:
        while cluster.step():
            bar.n = sum(r.finished for r in cluster.replicas)
    requests = [r for rep in cluster.replicas for r in rep.engine.requests.values()]
    timings = [t for rep in cluster.replicas
               for t in timings_from_trace(rep.engine.requests.values(), rep.engine.trace, "sim")]
    cluster.timings = timings
    tp = engines[0].config.tensor_parallel_size
    summary = {"mode": "co-located", "replicas": replicas, "router": router, "prefix_source": prefix_source,
               "max_imbalance": max_imbalance if router == "prefix" else None, "workload": workload,
               "num_requests": num_requests, "arrival_rate": arrival_rate, "burstiness": burstiness,
               "seed": seed, "sim_gpu": sim_gpu, "sim_model": sim_model, "tensor_parallel_size": tp,
               "clock": "sim"}
    gpus = replicas * engines[0].cost_model.num_gpus      # tensor x pipeline x expert parallel
    summary.update(totals(timings, cluster.replicas, requests, ps, slo, num_gpus=gpus))
    summary["per_replica"] = [replica_summary(r, ps, slo) for r in cluster.replicas]
    return summary, cluster
