"""Trace replay (harness/request_traces.py): the shipped Azure traces, windows, time
scales, bad CSVs, and the bench/simulate/sweep options that replay them."""
import csv
import json
import tomllib
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from minibatch_engine.entrypoints.cli import main
from minibatch_engine.harness.request_traces import (TRACE_DIR, TRACE_FILES, load_trace, trace_path, trace_workload,
                                             with_limit)
from minibatch_engine.harness.sweep import sweep
from minibatch_engine.harness.workload import make_workload

ROOT = Path(__file__).resolve().parents[2]


def _rows(name):
    with open(trace_path(name), newline="") as f:
        return [(float(r["arrived_at"]), int(float(r["num_prefill_tokens"])), int(float(r["num_decode_tokens"])))
                for r in csv.DictReader(f)]


@pytest.mark.parametrize("name,count", [("azure-conv", 19_366), ("azure-code", 8_819)])
def test_shipped_traces_load_with_their_readme_counts(name, count):
    t = load_trace(name)
    assert len(t) == count and t.name == name
    assert f"{count:,}" in (TRACE_DIR / "README.md").read_text()
    assert t.arrivals[0] == 0 and np.all(np.diff(t.arrivals) >= 0)
    assert t.lines[0] == 2 and t.lines[-1] == count + 1             # CSV lines, after the header


def test_traces_ship_as_package_data_with_their_readme_and_licence():
    """The folder holds the two CSVs, the README and Vidur's licence, and
    pyproject.toml's package-data ships every file in it."""
    files = {p.name for p in resources.files("minibatch_engine").joinpath("harness/traces").iterdir()}
    assert files >= {*TRACE_FILES.values(), "README.md", "LICENSE.vidur"}
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["minibatch_engine.harness"]
    unshipped = [f for f in files if not any(Path("traces", f).match(p) for p in patterns)]
    assert not unshipped, f"not shipped by pyproject.toml package-data: {unshipped}"


def test_replay_keeps_the_window_s_lengths_order_and_re_based_arrivals():
    start, duration = 600.0, 90.0
    rows = [r for r in _rows("azure-code") if start <= r[0] < start + duration]
    wl = trace_workload("azure-code", start, duration)
    specs = make_workload(wl, None, seed=1, vocab_size=100)
    assert len(specs) == len(rows) > 10
    assert [len(s.prompt_token_ids) for s in specs] == [p for _, p, _ in rows]
    assert [s.max_tokens for s in specs] == [d for _, _, d in rows]
    assert [s.arrival_time for s in specs] == [t - start for t, _, _ in rows]
    assert all(s.sampling_params().ignore_eos for s in specs)
    assert all(0 <= t < 100 for s in specs for t in s.prompt_token_ids)
    assert wl.trace.duration == duration and wl.rate == len(rows) / duration


def test_poisson_arrivals_keep_the_requests_and_the_mean_rate():
    """The Poisson twin of a window holds the same requests in the same order,
    at exponential gaps (coefficient of variation near 1) of the same mean."""
    t = load_trace("azure-code").window(600, 120)
    p = t.with_poisson_arrivals(seed=3)
    assert np.array_equal(p.prompt_lens, t.prompt_lens) and np.array_equal(p.output_lens, t.output_lens)
    assert np.array_equal(p.lines, t.lines) and p.name == f"{t.name}, Poisson arrivals"
    assert p.arrivals[0] == 0 and np.all(np.diff(p.arrivals) >= 0)
    assert abs(p.rate / t.rate - 1) < 0.15
    gaps = np.diff(p.arrivals)
    assert 0.8 < gaps.std() / gaps.mean() < 1.2 < np.diff(t.arrivals).std() / np.diff(t.arrivals).mean()
    assert np.array_equal(t.with_poisson_arrivals(seed=3).arrivals, p.arrivals)


def test_time_scale_divides_every_gap_and_num_requests_keeps_the_first():
    base = make_workload(trace_workload("azure-conv", 0, 120), None)
    fast = make_workload(trace_workload("azure-conv", 0, 120, time_scale=4), None)
    assert [s.arrival_time for s in fast] == [s.arrival_time / 4 for s in base]
    assert np.allclose(np.diff([s.arrival_time for s in fast]), np.diff([s.arrival_time for s in base]) / 4)
    first = make_workload(trace_workload("azure-conv", 0, 120, time_scale=4), 7)
    assert [(s.arrival_time, s.max_tokens) for s in first] == [(s.arrival_time, s.max_tokens) for s in fast[:7]]
    assert [s.prompt_token_ids for s in make_workload(trace_workload("azure-conv", 0, 120), 5, seed=3)] == \
        [s.prompt_token_ids for s in make_workload(trace_workload("azure-conv", 0, 120), 5, seed=3)]


def test_an_arrival_rate_sets_the_time_scale():
    wl = trace_workload("azure-conv", 0, 60)
    specs = make_workload(wl, None, arrival_rate=2 * wl.rate)
    assert [s.arrival_time for s in specs] == [a / 2 for a in wl.trace.arrivals]


def test_an_arrival_rate_is_the_replayed_requests_own_rate():
    """The first n requests of a window that starts dense (the code trace's
    first 240 of [600, 720) s arrive in about 19 s, three times the window's
    mean rate) replay at the rate asked: n over the next request's arrival."""
    wl = trace_workload("azure-code", 600, 120)
    n, rate = 240, 2.0
    assert n / wl.trace.arrivals[n] > 2.5 * wl.trace.rate          # the dense start
    specs = make_workload(wl, n, arrival_rate=rate)
    scale = rate / (n / wl.trace.arrivals[n])
    assert [s.arrival_time for s in specs] == [a / scale for a in wl.trace.arrivals[:n]]
    assert n / (wl.trace.arrivals[n] / scale) == pytest.approx(rate)


def test_overlong_requests_are_refused_or_clipped():
    wl = with_limit(trace_workload("azure-code", 0, 30), 2048)
    rows = [r for r in _rows("azure-code") if r[0] < 30]
    over = [i for i, (_, p, d) in enumerate(rows) if p + d > 2048]
    assert over
    with pytest.raises(ValueError, match=rf"{len(over)} of {len(rows)} requests .*CSV line {over[0] + 2}"):
        make_workload(wl, None)
    clipped = make_workload(trace_workload("azure-code", 0, 30, clip=True), None, max_model_len=2048)
    assert all(len(s.prompt_token_ids) + s.max_tokens <= 2048 for s in clipped)
    assert [s.max_tokens for s in clipped] == [d for _, _, d in rows]      # outputs under 2048 stay whole
    kept = [i for i in range(len(rows)) if i not in over]
    assert [len(clipped[i].prompt_token_ids) for i in kept] == [rows[i][1] for i in kept]


@pytest.mark.parametrize("text,match", [
    ("arrived_at,num_prefill_tokens\n0,5\n", r"line 1: .*lacks the column\(s\) num_decode_tokens"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,3\n1,x,3\n", r"line 3, column num_prefill_tokens: 'x'"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,3\n1,5,0\n", r"line 3, column num_decode_tokens"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n2,5,3\n1,5,3\n", r"line 3, column arrived_at: .*order"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5.5,3\n", r"line 2, column num_prefill_tokens"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5\n", r"line 2, column num_decode_tokens: missing"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n", "no requests"),
])
def test_a_bad_csv_names_the_file_line_and_column(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        load_trace(path)
    assert str(path) in str(e.value)


def test_any_csv_with_the_columns_replays(tmp_path, capsys):
    path = tmp_path / "mine.csv"
    path.write_text("num_decode_tokens,arrived_at,num_prefill_tokens,note\n4,0.0,30,a\n6,0.5,20.0,b\n3,2.0,9,c\n")
    out = tmp_path / "s.json"
    assert main(["simulate", "--trace", str(path), "--time-scale", "2", "--json", str(out), "--no-progress"]) == 0
    s = json.loads(out.read_text())
    assert s["num_requests"] == 3 and s["output_tokens"] == 4 + 6 + 3
    assert s["workload"].startswith("mine.csv, time x2")
    assert main(["simulate", "--trace", str(tmp_path / "none.csv"), "--no-progress"]) == 2
    assert "none.csv: no such file" in capsys.readouterr().err


def test_simulate_replays_a_window_of_the_code_trace(tmp_path):
    out = tmp_path / "s.json"
    rc = main(["simulate", "--workload", "azure-code", "--trace-duration", "60", "--time-scale", "2",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads(out.read_text())
    n = sum(r[0] < 60 for r in _rows("azure-code"))
    assert s["num_requests"] == n and s["output_tokens"] == sum(r[2] for r in _rows("azure-code") if r[0] < 60)
    assert s["workload"].startswith("azure-code [0, 60) s, time x2")


def test_trace_options_are_refused_where_they_mean_nothing(capsys):
    bad = [["simulate", "--time-scale", "2"],
           ["simulate", "--workload", "azure-conv", "--arrival-rate", "3"],
           ["simulate", "--workload", "azure-conv", "--trace", "x.csv"],
           ["simulate", "--workload", "azure-conv", "--trace-start", "99999"],
           ["simulate", "--workload", "azure-conv", "--max-model-len", "1024"],
           ["sweep", "--workload", "azure-conv", "--rates", "1", "--time-scale", "2",
            "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b"]]
    for argv in bad:
        assert main([*argv, "--no-progress"]) == 2, argv
    err = capsys.readouterr().err
    for text in ("shape a trace replay", "brings its own arrivals", "not both", "no request arrived",
                 "need more than --max-model-len (1024) tokens", "drop --time-scale"):
        assert text in err, text


def test_sweep_with_a_trace_scales_time_to_each_rate(tmp_path):
    wl = trace_workload("azure-code", 0, 30)
    rows = sweep([1, 4], workload=wl, num_requests=len(wl.trace), sim_gpu="H100-SXM", sim_model="llama-3-8b",
                 max_model_len=8192, jsonl=str(tmp_path / "s.jsonl"), progress=False)
    for r in rows:
        arrivals = r["latencies"]["arrival"]
        assert len(arrivals) == len(wl.trace)
        assert np.allclose(sorted(arrivals), wl.trace.arrivals * wl.trace.rate / r["rate"])
    assert rows[0]["workload"] == rows[1]["workload"] == str(wl)
    assert main(["sweep", "--workload", "azure-code", "--trace-duration", "30", "--rates", "2,8",
                 "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b", "--jsonl", str(tmp_path / "c.jsonl"),
                 "--no-progress"]) == 0
    assert len((tmp_path / "c.jsonl").read_text().splitlines()) == 2
