"""Serving under load: vLLM's benchmark metrics on hand-built traces, arrivals,
and the streaming front end (AsyncLLM)."""
import math

import numpy as np
import pytest

from minibatch_engine.metrics import (RequestTiming, parse_goodput, parse_percentiles, request_metrics,
                                      serving_metrics, timings_from_trace)
from minibatch_engine.request import Request
from minibatch_engine.sampling import SamplingParams
from minibatch_engine.trace import StepRecord, Trace
from minibatch_engine.workload import arrival_gaps, make_workload

# Three requests, times in seconds (worked by hand below):
#   a: arrives 0.0, tokens at 1.0 1.5 2.5 3.0 -> TTFT 1.0, E2EL 3.0, TPOT 2/3, ITL 0.5 1.0 0.5
#   b: arrives 1.0, one token at 1.5        -> TTFT 0.5, E2EL 0.5, no TPOT (one token)
#   c: arrives 2.0, tokens at 4.0 6.0       -> TTFT 2.0, E2EL 4.0, TPOT 2.0, ITL 2.0
STEP_ENDS = [1.0, 1.5, 2.5, 3.0, 4.0, 6.0]
REQS = {"a": (0.0, [0, 1, 2, 3]), "b": (1.0, [1]), "c": (2.0, [4, 5])}


def hand_trace():
    trace = Trace()
    for k, end in enumerate(STEP_ENDS):
        start = STEP_ENDS[k - 1] if k else 0.0
        trace.append(StepRecord(step=k, lanes=[], batch_id=None, computed_tokens=1, useful_tokens=1,
                                prefill_tokens=0, decode_tokens=1, num_running=1, sampled_tokens=1,
                                kv_reserved_bytes=0, kv_used_bytes=0, kv_capacity_bytes=0,
                                wall_start=start, wall_end=end, sim_start=start, sim_end=end))
    reqs = []
    for rid, (t0, steps) in REQS.items():
        r = Request(rid, [1, 2], SamplingParams(max_tokens=8))
        r.arrival_time = {"sim": t0, "wall": t0}
        r.arrival_step = next(k for k, e in enumerate(STEP_ENDS) if e > t0)
        for k in steps:
            r.append_token(7, k)
        reqs.append(r)
    return trace, reqs


def test_metric_definitions_on_a_hand_built_trace():
    trace, reqs = hand_trace()
    t = {r.request_id: x for r, x in zip(reqs, timings_from_trace(reqs, trace, "sim"))}
    assert (t["a"].ttft, t["a"].e2el, t["a"].itl) == (1.0, 3.0, [0.5, 1.0, 0.5])
    assert t["a"].tpot == pytest.approx(2 / 3) and t["c"].tpot == 2.0 and t["b"].tpot == 0.0
    m = request_metrics(reqs[0], trace).seconds["sim"]
    assert (m["ttft"], m["e2e"], m["itl"]) == (1.0, 3.0, [0.5, 1.0, 0.5]) and m["tpot"] == pytest.approx(2 / 3)
    assert request_metrics(reqs[0], trace).tpot_steps == 1.0      # (4 - 1) steps / 3 gaps

    s = serving_metrics(list(t.values()), ps=(50, 100), goodput={"ttft": 1000, "tpot": 1000})
    assert s["duration_s"] == 6.0 and s["completed"] == 3                 # first arrival 0 -> last token 6
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == pytest.approx(7 / 6)
    assert s["total_token_throughput"] == pytest.approx((7 + 6) / 6)
    assert (s["ttft_ms_p50"], s["ttft_ms_p100"], s["ttft_ms_mean"]) == pytest.approx((1000, 2000, 3500 / 3))
    # TPOT: one value per request of >= 2 tokens (a, c); b's single token is left out
    assert (s["tpot_ms_p50"], s["tpot_ms_mean"]) == pytest.approx(((2000 / 3 + 2000) / 2,) * 2)
    # ITL: every gap of every request, pooled: 500, 1000, 500, 2000
    assert (s["itl_ms_p50"], s["itl_ms_mean"], s["itl_ms_p100"]) == pytest.approx((750, 1000, 2000))
    assert (s["e2el_ms_p50"], s["e2el_ms_p100"]) == pytest.approx((3000, 4000))
    # goodput: a (TTFT 1000 <= 1000, TPOT 667) and b (TTFT 500, TPOT 0) meet both SLOs; c (TTFT 2000) misses
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(2 / 6)
    assert serving_metrics(list(t.values()), goodput={"e2el": 2999})["good_requests"] == 1   # only b
    assert serving_metrics(list(t.values()), goodput={"tpot": 1999})["good_requests"] == 2   # c's TPOT 2000
    assert "goodput" not in serving_metrics(list(t.values()))


def test_summary_keys_match_the_hand_computation_for_a_real_run():
    from minibatch_engine.bench import run_bench
    s, eng = run_bench(num_requests=30, max_batch=8, seed=2, sim_gpu="H100-SXM", sim_model="llama-3-8b",
                       simulate_only=True, progress=False, arrival_rate=50.0, goodput=["ttft:50"])
    reqs = list(eng.requests.values())
    t = timings_from_trace(reqs, eng.trace, "sim")
    assert s["clock"] == "sim" and s["completed"] == 30
    assert s["ttft_ms_p99"] == pytest.approx(np.percentile([x.ttft * 1e3 for x in t], 99))
    assert s["good_requests"] == sum(x.ttft <= 0.05 for x in t)
    first = min(r.arrival_time["sim"] for r in reqs)
    assert s["duration_s"] == pytest.approx(eng.trace.end_time("sim") - first)


def test_parse_percentiles_and_goodput():
    assert parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    assert parse_goodput(["ttft:200", "e2el:1500"]) == {"ttft": 200.0, "e2el": 1500.0}
    for bad in (["ttfb:2"], ["ttft"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)
    with pytest.raises(ValueError, match="percentiles"):
        parse_percentiles("50,abc")


def test_arrivals_poisson_and_bursty():
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    poisson = arrival_gaps(rng(), 20000, rate=4.0)
    assert poisson.mean() == pytest.approx(0.25, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1, abs=0.03)
    bursty = arrival_gaps(rng(), 20000, rate=4.0, burstiness=0.25)
    # same mean rate, coefficient of variation 1/sqrt(burstiness) = 2
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2, rel=0.05)
    a = make_workload("uniform", 50, seed=3, arrival_rate=2.0, burstiness=0.5)
    b = make_workload("uniform", 50, seed=3, arrival_rate=2.0, burstiness=0.5)
    assert [x.arrival_time for x in a] == [x.arrival_time for x in b]
    assert all(np.diff([x.arrival_time for x in a]) >= 0)
    with pytest.raises(ValueError, match="burstiness"):
        make_workload("uniform", 5, arrival_rate=1.0, burstiness=0)
    with pytest.raises(ValueError, match="arrival_rate"):
        make_workload("uniform", 5, arrival_rate=0.0)
    assert not math.isnan(a[-1].arrival_time)
