"""What a cluster run measured: per replica and in total.

The totals are vLLM's serving metrics over every request (as one client would
see the whole cluster), the steady-state keys of chapter 8, the prefix cache's
hit rate (prompt tokens served from a cache, over all prompt tokens) and the
balance of the load: each replica's busy seconds (the sum of its steps'
modelled times), and the busiest replica's over the mean (1: even).
"""
from __future__ import annotations

from typing import Sequence

from ..harness.metrics import RequestTiming, serving_metrics, timings_from_trace
from ..harness.sweep import steady_metrics
from .replicas import Replica

REPLICA_KEYS = ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_mean", "tpot_ms_p99")


def busy_seconds(replica: Replica) -> float:
    """Seconds of the replica's steps on its simulated clock."""
    return sum(s.sim_end - s.sim_start for s in replica.engine.trace)


def hit_rate(requests) -> float:
    """Prompt tokens found in a prefix cache, over all prompt tokens."""
    requests = list(requests)
    total = sum(r.num_prompt_tokens for r in requests)
    return sum(r.num_cached_tokens for r in requests) / total if total else float("nan")


def replica_summary(replica: Replica, ps, slo) -> dict:
    """One replica: its requests, cache hits, busy seconds, and latencies."""
    reqs = list(replica.engine.requests.values())
    out = {"index": replica.index, "pool": replica.pool, "requests": len(reqs),
           "prefix_hit_rate": hit_rate(reqs), "busy_s": busy_seconds(replica),
           "steps": len(replica.engine.trace),
           "prefill_tokens": sum(s.prefill_tokens for s in replica.engine.trace)}
    timings = timings_from_trace(reqs, replica.engine.trace, "sim")
    if timings:
        m = serving_metrics(timings, ps=ps, goodput=slo)
        out.update({k: m[k] for k in REPLICA_KEYS if k in m})
    return out


def totals(timings: Sequence[RequestTiming], replicas: Sequence[Replica], requests, ps, slo,
           num_gpus: int) -> dict:
    """The cluster's totals (see the module's docstring); ``num_gpus``: every
    GPU the cluster holds, for the per-GPU rates."""
    out = serving_metrics(timings, ps=ps, goodput=slo)
    out.update(steady_metrics(timings, goodput=slo))
    busy = [busy_seconds(r) for r in replicas]
    mean = sum(busy) / len(busy)
    out.update(num_gpus=num_gpus, prefix_hit_rate=hit_rate(requests),
               prefill_tokens=sum(s.prefill_tokens for r in replicas for s in r.engine.trace),
               load_imbalance=max(busy) / mean if mean else float("nan"),
               request_throughput_per_gpu=out["request_throughput"] / num_gpus)
    if slo:
        out["goodput_per_gpu"] = out["goodput"] / num_gpus
        out["steady_goodput_per_gpu"] = out["steady_goodput"] / num_gpus
    return out
