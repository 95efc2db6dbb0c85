"""The sweep's steady-state window (minibatch_engine.harness.sweep.steady_metrics) and
DistServe's goodput: counted over the window, an engine that keeps up shows the
offered rate, one that does not shows what it can serve; the whole-run count
(vLLM's) shows less than the offered rate even for the first, because of the drain."""
import math

import pytest

from minibatch_engine.harness.metrics import RequestTiming, serving_metrics
from minibatch_engine.harness.sweep import STEADY_WARMUP, distserve_goodput, steady_metrics, steady_window, sweep
from minibatch_engine.harness.workload import Uniform, WorkloadSpec


def fifo(n: int, gap: float, service: float, tokens: int = 5) -> list[RequestTiming]:
    """n requests every ``gap`` seconds through one server that takes
    ``service`` seconds per request, first come first served, its tokens
    evenly spread over the service."""
    out, free = [], 0.0
    for i in range(n):
        a = i * gap
        start = max(a, free)
        free = start + service
        out.append(RequestTiming(a, [start + service * (k + 1) / tokens for k in range(tokens)]))
    return out


def test_an_engine_that_keeps_up_shows_the_offered_rate_where_the_whole_run_does_not():
    # 4 requests/s, each served in 1 s at once (no queue): a drain of 1 s after 4.75 s of arrivals
    ts = [RequestTiming(i * 0.25, [i * 0.25 + 0.25 * (k + 1) for k in range(4)]) for i in range(20)]
    whole = serving_metrics(ts)
    assert whole["request_throughput"] == pytest.approx(20 / 5.75)        # 3.5: the drain's artefact
    assert steady_window(ts, warmup=0.1) == pytest.approx((0.475, 4.75))
    s = steady_metrics(ts, warmup=0.1)
    assert s["steady_window_s"] == pytest.approx(4.275)
    assert s["steady_offered_rate"] == pytest.approx(18 / 4.275)           # arrivals 0.5 .. 4.75
    assert s["steady_request_throughput"] == pytest.approx(16 / 4.275)     # completions 1.0 .. 4.75
    # with no warm-up the window is (first arrival, last arrival]
    s0 = steady_metrics(ts, warmup=0.0)
    assert s0["steady_offered_rate"] == 4.0
    assert s0["steady_output_throughput"] == sum(0 < x <= 4.75 for t in ts for x in t.token_times) / 4.75


def test_long_runs_converge_on_the_offered_rate_or_the_service_rate():
    keeps_up = steady_metrics(fifo(2000, gap=0.1, service=0.08))        # 10/s offered, 12.5/s capacity
    assert keeps_up["steady_request_throughput"] == pytest.approx(10, rel=0.01)
    assert keeps_up["steady_offered_rate"] == pytest.approx(10, rel=0.01)
    overloaded = steady_metrics(fifo(2000, gap=0.1, service=0.2))       # 10/s offered, 5/s capacity
    assert overloaded["steady_offered_rate"] == pytest.approx(10, rel=0.01)
    assert overloaded["steady_request_throughput"] == pytest.approx(5, rel=0.01)


def test_steady_goodput_counts_the_window_s_arrivals_that_met_every_slo():
    slo = {"ttft": 150}
    over = fifo(200, gap=0.1, service=0.2)      # the queue grows: after the first few, every TTFT misses
    s = steady_metrics(over, goodput=slo)
    assert s["steady_goodput"] == 0.0 and s["steady_slo_attainment"] == 0.0
    ok = fifo(200, gap=0.1, service=0.05)       # no queue: TTFT 10 ms, every request is good
    s = steady_metrics(ok, goodput=slo)
    assert s["steady_goodput"] == s["steady_offered_rate"] > 0
    assert s["steady_slo_attainment"] == 1.0
    assert "steady_goodput" not in steady_metrics(ok)                    # no SLO, no goodput
    # a window in which half of the arrivals miss: alternate fast and slow requests
    mixed = [RequestTiming(i * 1.0, [i * 1.0 + (0.1 if i % 2 else 0.3)]) for i in range(101)]
    s = steady_metrics(mixed, goodput={"ttft": 200}, warmup=0.0)
    assert s["steady_slo_attainment"] == pytest.approx(0.5)
    assert s["steady_goodput"] == pytest.approx(50 / 100)


def test_window_edge_cases():
    at_once = [RequestTiming(0.0, [0.1]), RequestTiming(0.0, [0.2])]
    s = steady_metrics(at_once, goodput={"ttft": 500})
    assert s["steady_window_s"] == 0 and math.isnan(s["steady_request_throughput"])
    assert math.isnan(s["steady_goodput"]) and math.isnan(s["steady_slo_attainment"])
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="warmup"):
            steady_metrics(at_once, warmup=bad)
    with pytest.raises(ValueError, match="no requests"):
        steady_window([])
    # a request that produced no token counts as offered and never as completed nor good
    lost = fifo(50, gap=0.1, service=0.05) + [RequestTiming(5.0, [])]
    s = steady_metrics(lost, goodput={"ttft": 500}, warmup=0.0)
    assert s["steady_offered_rate"] == pytest.approx(50 / 5.0)
    assert s["steady_slo_attainment"] == pytest.approx(49 / 50)


def test_distserve_goodput_is_the_highest_rate_at_the_target_attainment():
    rows = [{"rate": 20, "steady_slo_attainment": 0.85}, {"rate": 5, "steady_slo_attainment": 1.0},
            {"rate": 10, "steady_slo_attainment": 0.93}, {"rate": 40, "steady_slo_attainment": 0.95}]
    assert distserve_goodput(rows) == 10                   # 40 meets it, but 20 below it did not
    assert distserve_goodput(rows, attainment=0.8) == 40
    assert distserve_goodput(rows, attainment=0.99) == 5
    assert distserve_goodput([{"rate": 1, "steady_slo_attainment": float("nan")}]) is None
    with pytest.raises(ValueError, match="attainment"):
        distserve_goodput(rows, attainment=0)


def test_simulated_sweep_rows_carry_both_counts():
    rows = sweep([4, 400], progress=False, sim_gpu="H100-SXM", sim_model="llama-3-8b", workload="chat",
                 num_requests=120, max_batch=16, goodput={"ttft": 500, "tpot": 50})
    low, high = rows
    for r in rows:
        assert r["steady_window_s"] > 0 and r["steady_warmup"] == STEADY_WARMUP
        assert r["steady_goodput"] == pytest.approx(r["steady_slo_attainment"] * r["steady_offered_rate"])
    # at 4/s the engine keeps up: the window shows the offered rate, the whole run less
    assert low["steady_request_throughput"] == pytest.approx(low["steady_offered_rate"], rel=0.1)
    assert low["request_throughput"] < low["steady_request_throughput"]
    assert low["steady_slo_attainment"] == 1.0
    # at 400/s it cannot: it completes far less than arrives, and few of the window's arrivals are good
    assert high["steady_request_throughput"] < 0.5 * high["steady_offered_rate"]
    assert high["steady_slo_attainment"] < 0.5
    assert distserve_goodput(rows) == 4
    with pytest.raises(ValueError, match="warmup"):
        sweep([1], warmup=1.5, sim_gpu="H100-SXM", sim_model="llama-3-8b")


def test_min_duration_gives_the_high_rates_more_requests():
    opts = dict(progress=False, sim_gpu="H100-SXM", sim_model="llama-3-8b", workload="chat", max_batch=16)
    rows = sweep([2, 20], num_requests=30, min_duration_s=5, **opts)
    assert [r["num_requests"] for r in rows] == [30, 100]
    assert [r["completed"] for r in rows] == [30, 100]
    assert sweep([20], min_duration_s=2, **opts)[0]["num_requests"] == 40
    with pytest.raises(ValueError, match="min_duration_s"):
        sweep([1], min_duration_s=0, **opts)


def test_a_real_model_sweep_carries_the_window_too(tmp_path):
    # the tiny model on the wall clock, through AsyncLLM: a few short requests per rate
    path = tmp_path / "rows.jsonl"
    short = WorkloadSpec(Uniform(8, 16), Uniform(2, 4), "prompts 8-16, outputs 2-4")
    rows = sweep([50, 100], simulate=False, model="tiny", device="cpu", progress=False, jsonl=str(path),
                 workload=short, num_requests=6, max_batch=4, max_model_len=64,
                 goodput={"ttft": 60_000}, min_duration_s=0.1)
    assert [r["rate"] for r in rows] == [50.0, 100.0] and [r["num_requests"] for r in rows] == [6, 10]
    for r in rows:
        assert r["clock"] == "wall" and r["completed"] == r["num_requests"]
        assert r["steady_window_s"] > 0 and r["steady_slo_attainment"] == 1.0
    assert len(path.read_text().splitlines()) == 2
