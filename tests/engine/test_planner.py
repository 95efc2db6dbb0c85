"""The deployment planner (cluster/planner.py), its prices (cluster/pricing.py)
and MFU/MBU (harness/utilization.py): small windows of the Azure trace on an
8B model, so each plan takes seconds."""
import json

import numpy as np
import pytest

from minibatch_engine.cluster.planner import (Deployment, NoPlanError, _fit_reason, _Search,
                                              _workload_specs, plan_deployment)
from minibatch_engine.cluster.pricing import GPU_HOUR_USD, cost_per_million_tokens, gpu_hour_price
from minibatch_engine.cluster.replicas import Cluster, sim_engines
from minibatch_engine.cluster.router import make_router
from minibatch_engine.core.engine import Engine
from minibatch_engine.entrypoints.cli import main
from minibatch_engine.harness.metrics import serving_metrics, timings_from_trace
from minibatch_engine.harness.utilization import utilization
from minibatch_engine.model.config import get_preset
from minibatch_engine.sampling.params import SamplingParams
from minibatch_engine.sim import GPUS
from minibatch_engine.sim.hardware import get_gpu

SMALL = dict(model="llama-3-8b", gpu="A100-80GB", workload="azure-conv", rate=16.0, slo_ttft_ms=300.0,
             slo_tpot_ms=30.0, tp_sizes=(1, 2), budgets=(512, 2048), max_gpus=4, num_requests=40)


def _simulate(d: Deployment, percentile=90.0) -> tuple[float, float]:
    """The p-th TTFT and TPOT (ms) of ``d`` on SMALL's requests, simulated apart from the planner."""
    s = SMALL
    specs, _, _ = _workload_specs(s["workload"], s["rate"], s["num_requests"], 0, 0.0, None, 8192)
    longest = max(len(x.prompt_token_ids) + x.max_tokens for x in specs)
    engines = sim_engines(d.replicas, s["gpu"], s["model"], 256, -(-longest // 16) * 16,
                          tensor_parallel_size=d.tp, max_num_batched_tokens=d.budget)
    cluster = Cluster({"all": (engines, make_router("least-requests"))})
    for i, x in enumerate(specs):
        cluster.submit(x.prompt_token_ids, x.sampling_params(), x.arrival_time, f"r{i}")
    cluster.run()
    timings = [t for e in engines for t in timings_from_trace(e.requests.values(), e.trace, "sim")]
    assert len(timings) == len(specs)
    m = serving_metrics(timings, ps=(percentile,))
    return m[f"ttft_ms_p{percentile:g}"], m[f"tpot_ms_p{percentile:g}"]


@pytest.fixture(scope="module")
def small_plan():
    return plan_deployment(**SMALL)


def test_the_chosen_plan_meets_the_slo_when_simulated_again(small_plan):
    c = small_plan.chosen
    ttft, tpot = _simulate(c.deployment)
    assert (ttft, tpot) == pytest.approx((c.ttft_ms, c.tpot_ms))
    assert ttft <= SMALL["slo_ttft_ms"] and tpot <= SMALL["slo_tpot_ms"]
    assert c.meets_slo and c.headroom <= 1
    assert 0 < c.mfu < 1 and 0 < c.mbu < 1


def test_no_deployment_with_fewer_gpus_meets_the_slo(small_plan):
    """Brute force over the whole small space: every (TP, budget, replicas) within max_gpus."""
    feasible = []
    for tp in SMALL["tp_sizes"]:
        for budget in SMALL["budgets"]:
            for n in range(1, SMALL["max_gpus"] // tp + 1):
                ttft, tpot = _simulate(Deployment(tp, 1, n, budget))
                if ttft <= SMALL["slo_ttft_ms"] and tpot <= SMALL["slo_tpot_ms"]:
                    feasible.append(tp * n)
                    break                       # more replicas of this configuration only add GPUs
    assert feasible, "the small space must hold a feasible deployment for this test to mean anything"
    assert small_plan.chosen.deployment.gpus == min(feasible)
    assert min(feasible) > 1, "a one-GPU answer would not test the replica search"


def test_a_run_stops_once_the_ttft_percentile_is_settled():
    """An overloaded candidate stops early with a lower bound on its TTFT percentile, which the whole run exceeds."""
    specs, _, _ = _workload_specs("azure-conv", 16.0, 40, 0, 0.0, None, 8192)
    longest = max(len(x.prompt_token_ids) + x.max_tokens for x in specs)
    search = _Search("llama-3-8b", "A100-80GB", specs, -(-longest // 16) * 16, 150.0, 30.0, 90.0,
                     "least-requests", 256, 1.3, 1000.0, 5000.0, check_every=8)
    d = Deployment(1, 1, 1, 2048)
    c = search.run(d)[0]
    assert c.stopped and not c.meets_slo and c.ttft_ms > 150.0 and np.isnan(c.tpot_ms)
    ttft, _ = _simulate(d)
    assert ttft >= c.ttft_ms


def test_the_cost_per_million_tokens_is_gpus_times_price_over_tokens(small_plan):
    assert cost_per_million_tokens(8, 3.0, 1000.0) == pytest.approx(8 * 3.0 / 3600 / 1000.0 * 1e6)
    c, s = small_plan.chosen, small_plan.settings
    assert s["usd_per_gpu_hour"] == GPU_HOUR_USD["A100-80GB"].usd_per_gpu_hour
    assert c.cost_per_mtok == pytest.approx(c.deployment.gpus * s["usd_per_gpu_hour"] / 3600
                                            / s["offered_output_tokens_per_s"] * 1e6)
    specs, _, _ = _workload_specs("azure-conv", 16.0, 40, 0, 0.0, None, 8192)
    span = specs[-1].arrival_time - specs[0].arrival_time
    assert s["offered_output_tokens_per_s"] == pytest.approx(sum(x.max_tokens for x in specs) / span)
    total = sum(x.max_tokens + len(x.prompt_token_ids) for x in specs) / span
    assert c.cost_per_mtok_total == pytest.approx(c.deployment.gpus * s["usd_per_gpu_hour"] / 3600 / total * 1e6)


def test_every_simulated_gpu_has_a_cited_default_price():
    for g in GPUS.values():
        p = gpu_hour_price(g.name)
        assert p.usd_per_gpu_hour > 0 and "http" in p.source
    assert gpu_hour_price("H200", 2.5).usd_per_gpu_hour == 2.5
    with pytest.raises(ValueError, match="gpu_hour_usd"):
        gpu_hour_price("H200", -1.0)


def test_configurations_that_do_not_fit_are_skipped_with_the_reason():
    plan = plan_deployment("llama-3-70b", "H100-SXM", "azure-conv", 1.0, tp_sizes=(1, 8), pp_sizes=(1,), budgets=(2048,),
                           num_requests=10, max_gpus=8)
    (tp1,) = [k for k in plan.skipped if k.tp == 1]
    assert "weights do not fit" in tp1.reason and "141 GB" in tp1.reason
    assert plan.chosen.deployment.tp == 8
    # weights that fit, a KV cache that does not: 70B on two H100s leaves about 3 GB
    m = get_preset("llama-3-70b")
    assert _fit_reason(m, get_gpu("H100-SXM"), 2, 1, m.kv_bytes_per_token() * 8192) is None
    assert "no room for the KV cache" in _fit_reason(m, get_gpu("H100-SXM"), 2, 1, m.kv_bytes_per_token() * 20000)


def test_the_405b_preset_has_its_published_size_and_plans_on_h200():
    assert get_preset("llama-3.1-405b").num_parameters() == pytest.approx(405.9e9, rel=0.005)
    with pytest.raises(NoPlanError, match="need 12 or more H100-SXMs"):
        plan_deployment("llama-3.1-405b", "H100-SXM", "azure-conv", 1.0, num_requests=10, pp_sizes=(1,))
    across = plan_deployment("llama-3.1-405b", "H100-SXM", "azure-conv", 0.5, tp_sizes=(8,), pp_sizes=(1, 2),
                             budgets=(2048,), num_requests=10, slo_tpot_ms=80.0)
    assert across.chosen.deployment.pp == 2 and across.chosen.meets_slo      # two nodes' stages hold it
    plan = plan_deployment("llama-3.1-405b", "H200", "azure-conv", 0.5, tp_sizes=(8,), budgets=(2048,),
                           num_requests=10, slo_tpot_ms=60.0)
    assert plan.chosen.deployment.tp == 8 and plan.chosen.meets_slo


def test_unknown_names_and_impossible_slos_are_clear_errors():
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'"):
        plan_deployment("llama-9", "H100-SXM", rate=1.0)
    with pytest.raises(ValueError, match="unknown GPU 'B300'"):
        plan_deployment("llama-3-8b", "B300", rate=1.0)
    with pytest.raises(ValueError, match="unknown workload"):
        plan_deployment("llama-3-8b", "H100-SXM", "nope", rate=1.0)
    with pytest.raises(NoPlanError, match="misses the SLO at any replica count") as e:   # below the latency floor
        plan_deployment("llama-3-8b", "H100-SXM", rate=1.0, slo_tpot_ms=1.0, num_requests=10, budgets=(2048,))
    assert e.value.plan.chosen is None and e.value.plan.simulations == 0
    small = {**SMALL, "tp_sizes": (1,), "budgets": (2048,), "max_gpus": 1}    # too few GPUs for the rate
    with pytest.raises(NoPlanError, match="the closest: 1 GPUs") as e:
        plan_deployment(**small)
    assert e.value.plan.closest.deployment == Deployment(1, 1, 1, 2048)


def test_mfu_and_mbu_count_the_models_work():
    e = Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b", max_model_len=512)
    for i in range(4):
        e.add_request(list(range(100)), SamplingParams(max_tokens=20, ignore_eos=True), request_id=f"r{i}")
    e.run()
    span = e.sim_now
    u = utilization([e], span, 1)
    m, g = get_preset("llama-3-8b"), get_gpu("H100-SXM")
    tokens = 4 * (100 + 20 - 1)                       # the last sampled token is never fed back
    linear = 2 * m.num_parameters(include_embeddings=False) * tokens
    assert linear < u["model_flops"] < 1.1 * linear   # plus attention and the LM head: a few per cent here
    steps = len(e.trace)
    assert u["model_bytes"] > steps * m.num_parameters() * 2      # every weight read once per step, and the KV
    assert u["mfu"] == pytest.approx(u["model_flops"] / (span * g.peak_flops))
    assert u["mbu"] == pytest.approx(u["model_bytes"] / (span * g.hbm_bandwidth))
    assert u["mbu"] > u["mfu"]                        # decode-heavy: the memory side binds


def test_cli_plan_prints_the_plan_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", "llama-3-8b", "--gpu", "H200", "--rate", "2", "--num-requests", "20",
               "--tp", "1,2", "--budgets", "2048", "--gpu-hour-usd", "5", "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "plan: 1 GPUs" in text and "per million prompt + output tokens) at $5.00 per GPU-hour" in text and "MFU" in text
    d = json.loads(out.read_text())
    assert d["chosen"]["gpus"] == 1 and d["settings"]["usd_per_gpu_hour"] == 5
    assert np.isfinite(d["chosen"]["mfu"]) and d["candidates"]


def test_cli_plan_errors(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "H200", "--rate", "1", "--num-requests", "10",
                 "--slo-tpot-ms", "1", "--no-progress"]) == 2
    assert "error: no deployment of llama-3-8b on H200" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-9", "--gpu", "H200", "--rate", "1"]) == 2
    assert "invalid choice: 'llama-9'" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "H200", "--rate", "1", "--pp", "64"]) == 2
    assert "exceeds the model's 32 layers" in capsys.readouterr().err
