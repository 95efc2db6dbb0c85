"""The front doors: bench, simulate and generate on small inputs."""
import json
import subprocess
import sys

import pytest

from minibatch_engine.harness.bench import run_bench
from minibatch_engine.entrypoints.cli import main

KEYS = ["scheduler", "workload", "num_requests", "steps", "useful_tokens", "computed_tokens", "eta",
        "wall_seconds", "output_tokens_per_second", "sim_seconds", "ttft_steps_p50", "ttft_steps_p90",
        "ttft_steps_p99", "e2e_steps_p50", "e2e_steps_p99", "clock", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p90",
        "itl_ms_p99", "e2el_ms_p50", "e2el_ms_mean", "request_throughput", "output_throughput",
        "wall_ttft_ms_p50", "wall_e2el_ms_p99"]


def test_bench_json_and_plot(tmp_path):
    out, fig = tmp_path / "b.json", tmp_path / "t.png"
    rc = main(["bench", "--scheduler", "static", "--workload", "uniform", "--num-requests", "6",
               "--max-batch", "3", "--seed", "1", "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b",
               "--json", str(out), "--plot", str(fig), "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    for k in KEYS:
        assert k in data, k
    assert data["num_requests"] == 6 and 0 < data["eta"] <= 1
    assert data["useful_tokens"] <= data["computed_tokens"]
    assert fig.stat().st_size > 1000


def test_bench_is_deterministic_in_steps_and_sim_time():
    a, _ = run_bench(num_requests=5, max_batch=2, seed=3, sim_gpu="A100-80GB", sim_model="llama-2-7b",
                     simulate_only=True, progress=False, goodput={"ttft": 500})
    b, _ = run_bench(num_requests=5, max_batch=2, seed=3, sim_gpu="A100-80GB", sim_model="llama-2-7b",
                     simulate_only=True, progress=False, goodput={"ttft": 500})
    assert a["clock"] == "sim" and "wall_ttft_ms_p50" not in a      # no model ran: no wall latencies
    for k in ("steps", "eta", "sim_seconds", "ttft_ms_p90", "e2e_steps_p50", "goodput"):
        assert a[k] == b[k]


def test_bench_paged_continuous_keys(tmp_path):
    out = tmp_path / "p.json"
    assert main(["bench", "--scheduler", "continuous", "--kv", "paged", "--kv-budget", str(2 ** 22),
                 "--num-requests", "6", "--max-batch", "4", "--json", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    for k in ("kv_utilization", "peak_running", "prefix_cache_hit_tokens", "itl_steps_p99",
              "itl_ms_p50", "overhead_fraction", "batch_utilization"):
        assert k in data, k
    assert data["kv_layout"] == "paged" and data["kv_capacity_bytes"] <= 2 ** 22
    assert 0 < data["kv_utilization"] <= 1


def test_bench_chunked_prefill_flags(tmp_path):
    out = tmp_path / "c.json"
    assert main(["simulate", "--scheduler", "continuous", "--workload", "chat", "--num-requests", "8",
                 "--max-batch", "4", "--max-num-batched-tokens", "64", "--json", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert data["chunked_prefill"] is True and data["max_num_batched_tokens"] == 64
    assert "itl_ms_p99" in data and data["clock"] == "sim"
    assert main(["simulate", "--scheduler", "continuous", "--num-requests", "4", "--max-batch", "4",
                 "--max-num-batched-tokens", "64", "--no-chunked-prefill", "--no-progress"]) == 2


def test_bench_preemption_keys(tmp_path):
    out = tmp_path / "s.json"
    assert main(["simulate", "--scheduler", "continuous", "--kv", "paged", "--kv-budget", str(2 ** 27),
                 "--num-requests", "24", "--max-batch", "16", "--preemption", "swap",
                 "--swap-space", str(2 ** 30), "--json", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert data["preemptions"] > 0 and data["swapped_bytes"] > 0 and data["finished_requests"] == 24
    assert "recomputed_tokens" in data


def test_simulate_and_generate_commands_run(capsys):
    assert main(["simulate", "--num-requests", "4", "--max-batch", "2", "--no-progress"]) == 0
    assert "simulated H100-SXM" in capsys.readouterr().out
    assert main(["generate", "hello", "world", "--max-tokens", "4", "--device", "cpu"]) == 0
    assert "length" in capsys.readouterr().out


def test_bad_arguments_give_a_clear_error(capsys):
    assert main(["simulate", "--num-requests", "0", "--no-progress"]) == 2
    assert "--num-requests" in capsys.readouterr().err
    assert main(["bench", "--workload", "nope"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "minibatch_engine", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "bench" in r.stdout


def test_percentiles_and_goodput_flags(tmp_path):
    out = tmp_path / "g.json"
    assert main(["simulate", "--num-requests", "12", "--max-batch", "4", "--arrival-rate", "8",
                 "--burstiness", "0.5", "--percentiles", "50,99.9", "--goodput", "ttft:200", "tpot:30", "--json", str(out),
                 "--no-progress"]) == 0
    data = json.loads(out.read_text())
    assert "ttft_ms_p99.9" in data and "ttft_ms_p99" not in data and data["slo_tpot_ms"] == 30
    assert data["burstiness"] == 0.5 and data["arrival_rate"] == 8
    assert 0 <= data["good_requests"] <= data["completed"] == 12
    assert data["goodput"] == pytest.approx(data["good_requests"] / data["duration_s"])
    assert main(["simulate", "--num-requests", "2", "--goodput", "latency:5", "--no-progress"]) == 2
    assert main(["simulate", "--num-requests", "2", "--percentiles", "50,101", "--no-progress"]) == 2


def test_simulate_with_tensor_parallelism(capsys):
    """--tp shards a model that one GPU cannot hold; without it the run is refused
    with the memory it needs, as a usage error."""
    assert main(["simulate", "--sim-model", "llama-3-70b", "--tp", "4", "--num-requests", "4",
                 "--max-batch", "4", "--no-progress"]) == 0
    assert main(["simulate", "--sim-model", "llama-3-70b", "--num-requests", "4", "--no-progress"]) == 2
    assert "--tp 2 or more" in capsys.readouterr().err            # the engine's field, named by its flag


@pytest.mark.parametrize("argv", [["serve"], ["route", "--backend", "http://127.0.0.1:1"]])
def test_serve_and_route_name_the_missing_serve_extra(argv, monkeypatch, capsys):
    """Without aiohttp both commands stop with the package's name and the install that fixes it."""
    server = [m for m in sys.modules if m == "minibatch_engine.entrypoints.server" or m.startswith("minibatch_engine.entrypoints.server.")]
    for name in server:
        monkeypatch.delitem(sys.modules, name)      # imported afresh, so aiohttp is looked up again
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    try:
        assert main(argv) == 2
    finally:
        for name in [m for m in sys.modules if m.startswith("minibatch_engine.entrypoints.server") and m not in server]:
            del sys.modules[name]                   # what the failed import left: not the real modules
    err = capsys.readouterr().err
    assert f"{argv[0]} needs the serve extra (aiohttp is missing): pip install 'minibatch-engine[serve]'" in err
