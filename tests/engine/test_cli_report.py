"""What the CLI prints for a newcomer (issue 39, "A newcomer's first hour"): the
simulated model named, where --json and --plot went, rates and imbalance said
for what they are, help without a doubled default, plain log-axis labels, and
no progress bar sharing a piped result's line."""
import pytest

from minibatch_engine.entrypoints.cli import main


def test_bench_with_a_simulated_gpu_names_the_priced_model_and_its_outputs(capsys, tmp_path):
    json_path, plot_path = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b", "--num-requests", "4",
                 "--json", str(json_path), "--plot", str(plot_path)]) == 0
    out, err = capsys.readouterr()
    assert "priced as llama-3-8b on a simulated H100-SXM" in out
    assert f"json: {json_path}" in out and f"plot: {plot_path}" in out
    assert json_path.exists() and plot_path.exists()
    assert "\r" not in out + err and out.startswith("workload")      # piped: no progress bar


def test_sweep_says_where_its_rows_and_plot_went(capsys, tmp_path):
    rows_path, plot_path = tmp_path / "s.jsonl", tmp_path / "s.png"
    assert main(["sweep", "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b", "--num-requests", "8",
                 "--rates", "5,10", "--jsonl", str(rows_path), "--plot", str(plot_path)]) == 0
    out = capsys.readouterr().out
    assert f"rows: {rows_path} (" in out and f"plot: {plot_path} (latency and throughput" in out
    assert rows_path.exists() and plot_path.exists()


def test_simulate_says_what_its_rates_and_imbalance_are(capsys):
    assert main(["simulate", "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b", "--num-requests", "40",
                 "--arrival-rate", "30"]) == 0
    assert "completed (offered 30/s" in capsys.readouterr().out
    assert main(["simulate", "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b", "--num-requests", "20",
                 "--arrival-rate", "30", "--prefill-replicas", "1", "--decode-replicas", "1"]) == 0
    out = capsys.readouterr().out
    assert "req/s completed (offered 30/s)" in out
    assert "the busiest replica's busy time over the mean (prefill and decode" in out


def test_serve_help_says_each_default_once(capsys):
    assert main(["serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: --model)" in out and "(default: --model) (default: None)" not in out


def test_the_sweep_plots_log_axes_in_plain_numbers():
    from minibatch_engine.book.plotting import load_curves
    rows = [dict(rate=r, request_throughput=0.9 * r, ttft_ms_p99=10 + r, tpot_ms_p99=15 + r, goodput=0.8 * r)
            for r in (1, 5, 10, 20, 30)]
    fig = load_curves({"continuous": rows})
    fig.canvas.draw()
    labels = [t.get_text() for ax in fig.axes[:2] for minor in (False, True)
              for t in ax.get_yticklabels(minor=minor) if t.get_text()]
    assert "20" in labels and "40" in labels
    assert not [t for t in labels if "10^" in t or "times" in t]
