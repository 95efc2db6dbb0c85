"""Chapter 14's measurements: splitting a big model over GPUs (tensor, pipeline
and expert parallelism), mixture-of-experts decode, and deployments sized by
the planner.

Everything here prices with the simulator's calibrated cost model
(:class:`~minibatch_engine.sim.cost_model.CostModel`) or runs the planner
(:func:`~minibatch_engine.cluster.planner.plan_deployment`); the chapter shows
the numbers, this module only arranges them.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ..cluster.planner import NoPlanError, plan_deployment
from ..core.engine import Engine
from ..model.config import get_preset
from ..sim import CostModel, get_gpu
from ..sim.calibration import default_calibration
from ..sim.operators import send_recv_time
from ..sim.pipeline import gpipe_bubble_fraction, pipeline_time

SEND_RECV_CSV = Path(__file__).resolve().parents[2] / "data/gpu-profiles/network/h100_dgx/send_recv.csv"
BF16 = 2


def layout_label(tp: int, pp: int = 1, ep: int = 1) -> str:
    """``"TP8"``, ``"TP8xPP2"``, ``"EP8"``: a layout as the chapter names it."""
    parts = [f"TP{tp}"] if tp > 1 or ep == 1 else []
    parts += [f"PP{pp}"] if pp > 1 else []
    parts += [f"EP{ep}"] if ep > 1 else []
    return "x".join(parts)


def max_sequences(model: str, gpu: str, tp: int, pp: int, context: int) -> int:
    """Sequences of ``context`` tokens whose KV fits one replica, by the
    engine's own block pool (90% of each GPU's memory, weights first)."""
    e = Engine(None, sim_gpu=gpu, sim_model=model, tensor_parallel_size=tp,
               pipeline_parallel_size=pp, max_model_len=context, max_num_seqs=4096)
    return e.kv_cache.num_blocks * e.kv_cache.block_size // context


def layout_row(model: str, gpu: str, tp: int, pp: int, context: int = 2048,
               batch: int = 64, prompt: int = 2048, cap: int = 1024) -> dict:
    """One layout of ``model``: GPUs, nodes, weights per GPU, decode steps at
    batch 1 and ``batch`` (each sequence at ``context``), a ``prompt``-token
    prefill, what each step communicates, and decode throughput per GPU at the
    largest batch the KV memory holds (capped at ``cap`` sequences)."""
    cm = CostModel(get_gpu(gpu), get_preset(model), tensor_parallel_size=tp, pipeline_parallel_size=pp)
    d1, dB = [(1, context)], [(1, context)] * batch
    pf = [(prompt, prompt)]
    step = {name: cm.step_cost(s) for name, s in (("d1", d1), ("dB", dB), ("pf", pf))}
    timing = cm.pipeline_timing(dB)
    fits = max_sequences(model, gpu, tp, pp, context)
    big = min(fits, cap)
    big_s = cm.step_time([(1, context)] * big) if big else float("nan")
    return {"layout": layout_label(tp, pp), "tp": tp, "pp": pp, "gpus": tp * pp,
            "nodes": -(-tp * pp // cm.gpus_per_node),
            "weights GB/GPU": cm.weight_bytes_per_gpu / 1e9,
            "decode b1 ms": step["d1"].seconds * 1e3, f"decode b{batch} ms": step["dB"].seconds * 1e3,
            f"prefill {prompt} ms": step["pf"].seconds * 1e3,
            f"all-reduce ms b{batch}": step["dB"].parts.get("all-reduce", 0.0) * 1e3,
            f"hand-over ms b{batch}": sum(timing.handover_seconds) * 1e3,
            "bubble b1": cm.pipeline_timing(d1).bubble_fraction,
            f"bubble b{batch}": timing.bubble_fraction,
            "prefill bubble": cm.pipeline_timing(pf).bubble_fraction,
            "max seqs": fits, "batch used": big, "step ms at batch used": big_s * 1e3,
            "tok/s/GPU at batch used": big / big_s / (tp * pp) if big else 0.0}


def bytes_per_step(model: str, tp: int, pp: int, tokens: int) -> dict:
    """What one step of ``tokens`` new tokens communicates, per GPU, in MB:
    tensor parallelism's two ring all-reduces per layer (each GPU sends
    ``2 (tp - 1) / tp`` of a ``[tokens, hidden]`` bf16 message) and pipeline
    parallelism's hand-over at each stage boundary (hidden states and residual,
    split over the ``tp`` GPUs of a stage)."""
    m = get_preset(model)
    message = tokens * m.hidden_size * BF16
    layers = m.num_layers / pp
    ar = 2 * layers * message * 2 * (tp - 1) / tp if tp > 1 else 0.0
    handover = 2 * message / tp if pp > 1 else 0.0
    return {"all-reduce MB": ar / 1e6, "hand-over MB": handover / 1e6}


def moe_layouts(model: str, gpu: str, layouts, batches, context: int = 1024, imbalance: float = 1.3) -> list[dict]:
    """Decode step times (ms) of a mixture of experts under tensor and expert
    parallelism: one row per ``(tp, ep)``, one column per batch; expert
    parallelism also with the busiest GPU at ``imbalance`` times the mean load."""
    rows = []
    for tp, ep in layouts:
        for rho in ((1.0,) if ep == 1 else (1.0, imbalance)):
            cm = CostModel(get_gpu(gpu), get_preset(model), tensor_parallel_size=tp, expert_parallel_size=ep,
                           expert_load_imbalance=rho)
            label = layout_label(tp, 1, ep) + (f", imbalance {rho:g}" if rho != 1.0 else "")
            row = {"layout": label, "gpus": tp * ep, "weights GB/GPU": cm.weight_bytes_per_gpu / 1e9}
            for b in batches:
                cost = cm.step_cost([(1, context)] * b)
                row[f"b{b} ms"] = cost.seconds * 1e3
                row[f"b{b} a2a ms"] = sum(v for k, v in cost.parts.items() if "all-to-all" in k) * 1e3
            rows.append(row)
    return rows


def send_recv_errors(path: Path = SEND_RECV_CSV) -> list[dict]:
    """The send/recv fit against every measured row of the H100 DGX CSV: the
    median and 90th-percentile relative error by placement and message size."""
    cal, gpu = default_calibration(), get_gpu("H100-SXM")
    groups: dict[tuple[str, str], list[float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            across = int(row["devices_per_node"]) == 1
            size = float(row["size"])
            measured = float(row["time_stats.send_recv.median"]) * 1e-3
            err = abs(send_recv_time(size, gpu, across, cal) / measured - 1)
            band = "under 1 MiB" if size < 2**20 else "1-8 MiB" if size < 8 * 2**20 else "8 MiB and more"
            groups.setdefault(("across nodes" if across else "within a node", band), []).append(err)
    return [{"placement": p, "size": s, "rows": len(e), "median error": float(np.median(e)),
             "p90 error": float(np.percentile(e, 90))} for (p, s), e in groups.items()]


def gpipe_check(pp: int, microbatches: int, stage_s: float = 1.0) -> tuple[float, float]:
    """The simulator's GPipe bubble for equal stages and free hand-overs, and
    GPipe's formula ``(pp - 1) / (m + pp - 1)``: the two must agree."""
    t = [[stage_s] * microbatches for _ in range(pp)]
    timing = pipeline_time(t, None, None, "gpipe")
    return timing.bubble_fraction, gpipe_bubble_fraction(pp, microbatches)


PLAN_SEARCH = dict(num_requests=200, trace_start=600.0, tp_sizes=(2, 4, 8), pp_sizes=(1, 2, 4),
                   budgets=(512, 2048))


def plan_point(point) -> dict:
    """The planner's answer for ``(model, gpu, workload, rate, slo_ttft_ms,
    slo_tpot_ms)`` with the chapter's search (:data:`PLAN_SEARCH`), as plain
    data: the chosen plan, or None and the closest candidate."""
    model, gpu, workload, rate, ttft, tpot = point
    try:
        plan, found = plan_deployment(model, gpu, workload, rate, slo_ttft_ms=ttft, slo_tpot_ms=tpot,
                                      **PLAN_SEARCH), True
    except NoPlanError as e:
        plan, found = e.plan, False
    s = plan.settings
    keep = ("gpus", "tp", "pp", "replicas", "budget", "ttft_ms", "tpot_ms", "output_throughput",
            "cost_per_mtok", "cost_per_mtok_total", "mfu", "mbu", "meets_slo", "stopped")
    closest = plan.closest
    return {"chosen": {k: plan.chosen.row()[k] for k in keep} if found else None,
            "closest": {k: closest.row()[k] for k in keep} if closest else None,
            "skipped": [f"TP{k.tp}xPP{k.pp}" + (f" budget {k.budget}" if k.budget else "") + f": {k.reason}"
                        for k in plan.skipped if not k.reason.startswith("pruned")],
            "offered output tok/s": s["offered_output_tokens_per_s"], "offered tok/s": s["offered_tokens_per_s"],
            "usd_per_gpu_hour": s["usd_per_gpu_hour"], "simulations": plan.simulations}


SLOS = {"llama-3-70b": (500.0, 50.0), "llama-3.1-405b": (1000.0, 100.0)}   # p90 TTFT, TPOT (ms)
DEPLOY_SEARCH = dict(num_requests=200, trace_start=600.0, budgets=(2048,))


def deploy_point(point) -> dict:
    """The explorable's grid: ``(model, gpu, tp, pp, rate)`` on the conversation
    trace, the fewest replicas of that one layout (token budget 2,048) meeting
    the model's SLO in :data:`SLOS`. Returns the replicas, GPUs, p90 TTFT and
    TPOT (ms) and USD per million output tokens, or why there is no plan."""
    model, gpu, tp, pp, rate = point
    ttft, tpot = SLOS[model]
    try:
        plan = plan_deployment(model, gpu, "azure-conv", rate, slo_ttft_ms=ttft, slo_tpot_ms=tpot,
                               tp_sizes=(tp,), pp_sizes=(pp,), **DEPLOY_SEARCH)
    except NoPlanError as e:
        skipped = e.plan.skipped
        c = e.plan.closest
        if c is not None:
            why = (f"no replica count up to 64 GPUs meets the SLO; {c.deployment.gpus} GPUs reach "
                   + (f"a p90 TTFT above {c.ttft_ms:,.0f} ms" if c.stopped
                      else f"p90 TTFT {c.ttft_ms:,.0f} ms, TPOT {c.tpot_ms:.1f} ms"))
        else:
            why = skipped[0].reason if skipped else "nothing could be simulated"
        return {"ok": False, "why": why}
    c = plan.chosen
    return {"ok": True, "replicas": c.deployment.replicas, "gpus": c.deployment.gpus, "ttft_ms": c.ttft_ms,
            "tpot_ms": c.tpot_ms, "cost_per_mtok": c.cost_per_mtok}
