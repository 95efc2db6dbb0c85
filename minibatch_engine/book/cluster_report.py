"""Runs, tables and figures for chapter 12 (many engines)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from tqdm.auto import tqdm

from ..cluster import simulate_cluster
from ..cluster.disagg import simulate_disaggregated
from ..harness.metrics import RequestTiming
from ..harness.sweep import distserve_goodput, steady_metrics
from ..harness.workload import Uniform, WorkloadSpec
from . import plotting
from .report import Table

PD_WORKLOADS = {
    "long prompts": WorkloadSpec(Uniform(1536, 2560), Uniform(64, 128), "prompts 1536-2560, outputs 64-128"),
    "long outputs": WorkloadSpec(Uniform(128, 256), Uniform(384, 512), "prompts 128-256, outputs 384-512"),
}
SLO_PAIRS = {"tight TPOT": {"ttft": 1000, "tpot": 10}, "tight TTFT": {"ttft": 150, "tpot": 50}}
DESIGNS = ("co-located", "disaggregated")
STYLES = {"co-located": ("#4C72B0", "o-"), "co-located, budget 512": ("#55A868", "^-"),
          "co-located, budget 256": ("#8172B3", "v-"), "disaggregated": ("#DD8452", "s--"),
          "disaggregated, TTFT at prefill": ("#C44E52", "d:"),
          "disaggregated 1:3": ("#937860", "<--"), "disaggregated 2:2": ("#DD8452", "s--"),
          "disaggregated 3:1": ("#C44E52", ">--")}


def policy_table(runs: Mapping[str, Mapping]) -> Table:
    """One line per router policy: cache hits, prefill work, latency, balance."""
    return Table([[name, s["prefix_hit_rate"], s["prefill_tokens"], s["ttft_ms_p50"], s["ttft_ms_p99"],
                   s["tpot_ms_p99"], s["load_imbalance"], " / ".join(str(r["requests"]) for r in s["per_replica"])]
                  for name, s in runs.items()],
                 ["router", "prefix hit rate", "prefill tokens computed", "TTFT p50 (ms)", "TTFT p99 (ms)",
                  "TPOT p99 (ms)", "busiest / mean busy time", "requests per replica"], floatfmt=".2f")


def pd_run(design: str, spec, rate: float, num_requests: int, link: str = "nvlink", num_gpus: int = 2, **sim):
    """One rate of one design on ``num_gpus`` GPUs: as many co-located replicas
    behind a least-requests router (``"co-located, budget N"``: with a token
    budget of ``N`` per step instead of the default), or prefill and decode
    replicas: one of each for ``"disaggregated"``, ``P`` and ``D`` for
    ``"disaggregated P:D"`` (``P + D`` must be ``num_gpus``)."""
    if design.startswith("co-located"):
        budget = design.partition("budget ")[2]
        opts = {"max_num_batched_tokens": int(budget)} if budget else {}
        return simulate_cluster(num_gpus, "least-requests", spec, num_requests, arrival_rate=rate, **opts, **sim)
    p, d = split_of(design, num_gpus)
    return simulate_disaggregated(p, d, link, spec, num_requests, arrival_rate=rate, **sim)


def split_of(design: str, num_gpus: int = 2) -> tuple[int, int]:
    """The (prefill, decode) replicas of a disaggregated design's name."""
    ratio = design.partition("disaggregated")[2].strip()
    p, d = (int(x) for x in ratio.split(":")) if ratio else (1, 1)
    if p < 1 or d < 1 or p + d != num_gpus:
        raise ValueError(f"design {design!r}: {p} prefill + {d} decode replicas on {num_gpus} GPUs; "
                         "each pool needs one replica or more, and together they take every GPU")
    return p, d


# The papers' convention (DistServe, Splitwise): TTFT ends when the prefill
# replica emits the first token. The "disaggregated" rows use the deployments'
# convention instead (vLLM's P/D proxy with the NIXL connector, Dynamo, llm-d):
# the decode worker streams every token, the first included.
ALT = "disaggregated, TTFT at prefill"


def decode_side_timings(timings) -> list[RequestTiming]:
    """What a client sees when the decode side streams every token (vLLM's
    disaggregated-prefill proxy, Dynamo, llm-d): the first token comes with the
    second, from the decode replica."""
    return [RequestTiming(t.arrival, [t.token_times[1], *t.token_times[1:]], t.num_prompt_tokens)
            if len(t.token_times) > 1 else t for t in timings]


def _p(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def _row(w, design, rate, timings, slos, **extra):
    row = {"workload": w, "design": design, "rate": rate,
           "ttft_ms_p90": _p([1e3 * t.ttft for t in timings if t.token_times], 90),
           "tpot_ms_p90": _p([1e3 * t.tpot for t in timings if len(t.token_times) > 1], 90), **extra}
    for name, slo in slos.items():
        m = steady_metrics(timings, goodput=slo)
        row[f"attainment {name}"], row[f"goodput {name}"] = m["steady_slo_attainment"], m["steady_goodput"]
    return row


def pd_jobs(rates: Mapping[str, Sequence[float]], designs: Mapping[str, Sequence[str]] | None = None,
            workloads=PD_WORKLOADS) -> list[tuple[str, float, str]]:
    """Every (workload, rate, design) of a P/D sweep (``designs``: per workload,
    default :data:`DESIGNS`)."""
    designs = designs or {w: DESIGNS for w in workloads}
    return [(w, r, d) for w in workloads for r in rates[w] for d in designs[w]]


def pd_rows(job: tuple[str, float, str], num_requests: int = 120, workloads=PD_WORKLOADS,
            slos=SLO_PAIRS, num_gpus: int = 2, **sim) -> list[dict]:
    """One (workload, rate, design) of the sweep: p90 TTFT and TPOT, busy shares,
    and for each SLO pair the steady-state attainment and goodput (chapter 8's
    keys). A disaggregated run counts TTFT when the decode side emits the first
    token (:func:`decode_side_timings`), as deployed P/D systems stream it; its
    ``gap_ms`` lists each request's gap between the prefill side's first token
    and the decode side's second. It gives a second row, ``design +
    ", TTFT at prefill"`` (:data:`ALT` for ``"disaggregated"``): the same run
    with TTFT ended at the prefill replica, the papers' convention."""
    w, rate, design = job
    s, cluster = pd_run(design, workloads[w], rate, num_requests, num_gpus=num_gpus, **sim)
    busy = {}
    for r in s["per_replica"]:
        busy.setdefault(r.get("pool", "all"), []).append(r["busy_s"] / s["duration_s"])
    extra = {"busy": {k: sum(v) / len(v) for k, v in busy.items()},
             "kv_transfer_ms_mean": s.get("kv_transfer_ms_mean")}
    if not design.startswith("disaggregated"):
        return [_row(w, design, rate, cluster.timings, slos, **extra)]
    gaps = [1e3 * (t.token_times[1] - t.token_times[0]) for t in cluster.timings
            if len(t.token_times) > 1]
    return [_row(w, design, rate, decode_side_timings(cluster.timings), slos, gap_ms=gaps, **extra),
            _row(w, design + ALT.removeprefix("disaggregated"), rate, cluster.timings, slos, **extra)]


def pd_sweep(rates: Mapping[str, Sequence[float]], num_requests: int = 120, workloads=PD_WORKLOADS,
             slos=SLO_PAIRS, designs: Mapping[str, Sequence[str]] | None = None, progress: bool = True,
             **sim) -> list[dict]:
    """The rows of every (workload, rate, design) (:func:`pd_jobs`, :func:`pd_rows`)."""
    jobs = pd_jobs(rates, designs, workloads)
    return [row for job in tqdm(jobs, desc="P/D sweep", disable=not progress)
            for row in pd_rows(job, num_requests, workloads, slos, **sim)]


def select(rows, workload: str, design: str) -> list[dict]:
    return [r for r in rows if r["workload"] == workload and r["design"] == design]


def distserve_per_gpu(rows, workload: str, design: str, slo: str, num_gpus: int = 2,
                      attainment: float = 0.9) -> tuple[float, bool]:
    """DistServe's goodput per GPU: the highest rate of the sweep at which
    ``attainment`` of the requests met the SLO pair (and every lower rate
    too), over the GPUs (0: not even the lowest); and whether that is the
    sweep's highest rate (the true goodput may then be higher)."""
    sel = select(rows, workload, design)
    best = distserve_goodput(sel, attainment, key=f"attainment {slo}")
    return (best or 0.0) / num_gpus, best == max(r["rate"] for r in sel)


def pd_figure(rows, slos=SLO_PAIRS, workloads=PD_WORKLOADS, attainment: float = 0.9, num_gpus: int = 2,
              designs: Sequence[str] | None = None):
    """Attainment against the rate, a panel per (workload, SLO pair), a line per
    design (``designs``: those drawn, default every design in ``rows``)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(workloads), len(slos), figsize=(9, 5.5), sharey=True)
    plt.close(fig)
    for i, w in enumerate(workloads):
        for j, name in enumerate(slos):
            ax = axes[i][j]
            present = [d for d in (designs or dict.fromkeys(r["design"] for r in rows)) if select(rows, w, d)]
            for d in present:
                sel = select(rows, w, d)
                color, style = STYLES.get(d, ("#8C8C8C", "x-"))
                ax.plot([r["rate"] for r in sel], [r[f"attainment {name}"] for r in sel], style, color=color,
                        label=d, ms=5)
            ax.axhline(attainment, color="#8C8C8C", ls="--", lw=1)
            slo = slos[name]
            ax.set_title(f"{w}; TTFT ≤ {slo['ttft']} ms, TPOT ≤ {slo['tpot']} ms", fontsize=9)
            ax.set_xlabel(f"request rate (req/s), {num_gpus} GPUs" if i == len(workloads) - 1 else "")
            if j == 0:
                ax.set_ylabel("met both SLOs")
    axes[0][0].legend(fontsize=7)
    return fig


def balance_figure(runs: Mapping[str, Mapping]):
    """Requests per replica, a group of bars per router setting."""
    fig, ax = plotting._axes(None, (7, 3))
    names = list(runs)
    n = len(runs[names[0]]["per_replica"])
    width = 0.8 / n
    for k in range(n):
        ax.bar([i + k * width for i in range(len(names))], [runs[m]["per_replica"][k]["requests"] for m in names],
               width, label=f"replica {k}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, fontsize=8)
    ax.set_ylabel("requests routed")
    ax.legend(fontsize=8, ncol=n)
    return fig


def glue_runs(prefix: str, runs: Mapping[str, Mapping], keys: Mapping[str, str]) -> None:
    """Glue ``{prefix}_{name}_{short}`` for every run and every ``short: key``
    (run names with spaces and commas become underscores)."""
    from .glue import glue
    for name, s in runs.items():
        tag = name.replace(", ", "_").replace(" ", "_").replace("-", "_")
        for short, key in keys.items():
            glue(f"{prefix}_{tag}_{short}", s[key], display=False)


def link_table(cost_model, prompt_tokens: int, links) -> tuple[Table, dict]:
    """Seconds to move one prompt's KV over each link, beside its prefill's."""
    nbytes = prompt_tokens * cost_model.kv_bytes_per_token
    prefill_s = cost_model.step_time([(prompt_tokens, prompt_tokens)])
    out = {name: link.transfer_seconds(nbytes) for name, link in links.items()}
    table = Table([[name, link.bandwidth / 1e9, 1e3 * out[name], out[name] / prefill_s]
                   for name, link in links.items()],
                  ["link", "GB/s each way", "transfer (ms)", "share of the prefill's time"], floatfmt=".3f")
    return table, {"bytes": nbytes, "prefill_s": prefill_s, **out}
