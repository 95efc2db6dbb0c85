"""The explorables (minibatch_engine/book/explorables): their HTML is
deterministic, their checks are the chapter's own numbers, and every formula
the browser computes agrees with its Python original (run through Node.js
where it is installed; the browser check compares them again on the site)."""
import json
import re
import shutil
import subprocess
from importlib import resources

import numpy as np
import pytest

from minibatch_engine.book.efficiency import eta_run
from minibatch_engine.book.explorables import Explorable, eta_explorer
from minibatch_engine.book.explorables.base import rounded

NODE = shutil.which("node")


def _js(*names):
    return "\n".join(resources.files("minibatch_engine.book.explorables").joinpath("static", n)
                     .read_text() for n in names)


def run_js(body: str, *scripts: str):
    """Evaluate ``body`` (an expression) after the given static scripts, in Node."""
    prelude = "globalThis.window = globalThis;\n" + _js("base.js", *scripts)
    out = subprocess.run([NODE, "-e", prelude + f"\nprocess.stdout.write(JSON.stringify({body}));"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _lengths(sigma, n=40):
    rng = np.random.default_rng(int(sigma * 100))
    return [(int(p), int(g)) for p, g in zip(rng.integers(1, 60, n), rng.integers(1, 200, n))]


def test_the_html_is_deterministic_and_named():
    a = eta_explorer(_lengths, [0.0, 0.5, 1.0, 2.0], checks=[(1.0, 4)])._repr_html_()
    b = eta_explorer(_lengths, [0.0, 0.5, 1.0, 2.0], checks=[(1.0, 4)])._repr_html_()
    assert a == b
    assert 'id="mbe-ch2-eta"' in a and "http" not in re.sub(r"http://www.w3.org/2000/svg", "", a)
    assert "</script>" not in a.split('class="mbe-data">')[1].split("</script>")[0]


def test_eta_checks_are_eta_run():
    sigmas = [0.0, 0.5, 1.0, 2.0]
    e = eta_explorer(_lengths, sigmas, checks=[(1.0, 4), (2.0, 64), (0.0, 1)])
    for chk, (s, b) in zip(e.checks, [(1.0, 4), (2.0, 64), (0.0, 1)]):
        assert chk["set"] == {"sigma": sigmas.index(s), "batch": b}
        assert chk["expect"]["eta"] == pytest.approx(eta_run(_lengths(s), b), rel=1e-6)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="sigma 0.3 is not on the grid"):
        eta_explorer(_lengths, [0.0, 1.0], checks=[(0.3, 4)])
    with pytest.raises(ValueError, match="explorable name"):
        Explorable("Bad Name", "eta", {})
    with pytest.raises(ValueError, match="no static/nope.js"):
        Explorable("ok", "nope", {})


def test_rounded_keeps_six_significant_digits():
    assert rounded({"a": [1 / 3, 2], "b": float("nan")}) == {"a": [0.333333, 2], "b": None}


@pytest.mark.skipif(NODE is None, reason="needs node")
@pytest.mark.parametrize("batch", [1, 3, 16, 64])
def test_the_browser_eta_is_eta_run(batch):
    lengths = _lengths(1.0, n=50)
    p, g = [x for x, _ in lengths], [y for _, y in lengths]
    got = run_js(f"MBE.etaRun({p}, {g}, {batch})", "eta.js")
    assert got["eta"] == pytest.approx(eta_run(lengths, batch), rel=1e-12)


@pytest.mark.skipif(NODE is None, reason="needs node")
def test_the_browser_percentile_is_numpys():
    x = sorted(np.random.default_rng(0).exponential(1.0, 37).round(4).tolist())
    ps = [0, 1, 25, 50, 90, 99, 99.9, 100]
    got = run_js(f"{ps}.map(function (p) {{ return MBE.percentile({x}, p); }})")
    assert got == pytest.approx([float(np.percentile(x, p)) for p in ps], rel=1e-12)


SIM = dict(sim_gpu="H100-SXM", sim_model="llama-3-8b")


def _sim_engine(scheduler, lengths, B=4):
    from minibatch_engine import Engine, EngineConfig, SamplingParams
    engine = Engine(None, EngineConfig(scheduler=scheduler, max_num_seqs=B, max_model_len=256,
                                       kv_layout="reserved", max_num_batched_tokens=None, **SIM))
    for i, (p, g) in enumerate(lengths):
        engine.add_request([1 + i] * p, SamplingParams(max_tokens=g, ignore_eos=True))
    engine.run()
    return engine


def test_a_trace_panel_holds_every_lane_and_the_totals_check_the_trace():
    from minibatch_engine.book.explorables import step_scrubber, totals_check, trace_panel
    from minibatch_engine.book.explorables.timeline import KIND, KINDS
    lengths = [(12, 30), (40, 8), (8, 60), (25, 15), (30, 45), (10, 5)]
    traces = {k: _sim_engine(k, lengths).trace for k in ("static", "continuous")}
    for key, tr in traces.items():
        panel = trace_panel(tr, key, key)
        assert len(panel["steps"]) == len(tr)
        # what the page sums: every lane's tokens, padding apart
        assert sum(c[2] for cells in panel["steps"] for c in cells) == tr.computed_tokens
        pad = sum(c[2] for cells in panel["steps"] for c in cells if c[1] == 4)
        assert pad == tr.computed_tokens - tr.useful_tokens
    if NODE is not None:
        # a static prefill step pads the shorter prompts: their rows show prefill
        panel = trace_panel(traces["static"], "static", "static")
        kinds = [list(k) for k in KINDS]
        got = run_js(f"MBE.rowStates({json.dumps(panel['steps'][0])}, {json.dumps(kinds)})",
                     "timeline.js")
        assert any(c[1] == KIND["pad"] for c in panel["steps"][0])
        assert {KINDS[lane[1]][0] for lane in got.values()} == {"prefill"}
    chk = totals_check(traces)
    assert chk["set"] == {"step": max(len(t) for t in traces.values()) - 1}
    assert chk["expect"]["continuous-pad"] == 0
    e = step_scrubber("t", {"": [trace_panel(t, k, k) for k, t in traces.items()]}, checks=[chk])
    assert 'data-kind="timeline"' in e._repr_html_()
    with pytest.raises(ValueError, match="rows must be"):
        trace_panel(traces["static"], "s", "s", rows="blocks")


def test_the_sweep_keeps_each_requests_latencies_and_they_give_its_numbers(tmp_path):
    from minibatch_engine.harness.sweep import sweep
    from minibatch_engine.book.explorables import sweep_latency
    slo = {"ttft": 500, "tpot": 50}
    path = tmp_path / "rows.jsonl"
    curves = {"paged": sweep([8, 200], progress=False, workload="chat", num_requests=60, max_batch=16,
                             goodput=slo, jsonl=str(path), **SIM)}
    assert "latencies" not in path.read_text()
    for row in curves["paged"]:
        lat = row["latencies"]
        assert np.percentile(lat["ttft_ms"], 99) == pytest.approx(row["ttft_ms_p99"])
        assert np.percentile([x for x in lat["tpot_ms"] if x is not None], 99) == \
            pytest.approx(row["tpot_ms_p99"])
    e = sweep_latency(curves, slo)
    assert [c["set"]["rate"] for c in e.checks] == [0, 1]
    # the page's "met the SLO" is the sweep's: the window's arrivals only
    assert [c["expect"]["paged-met"] for c in e.checks] == \
        pytest.approx([row["steady_slo_attainment"] for row in curves["paged"]], rel=1e-5)
    if NODE is None:
        return
    for k, row in enumerate(curves["paged"]):
        run = e.data["cells"][str(k)][0]
        got = run_js(f"MBE.goodput({json.dumps(run)}, {json.dumps(slo)})", "latency.js")
        # the page's data hold 6 significant digits (the window's ends too): the
        # browser check's tolerance, 1e-5
        assert got["goodput"] == pytest.approx(row["steady_goodput"], rel=1e-5)
        assert got["attainment"] == pytest.approx(row["steady_slo_attainment"], rel=1e-5)
        met = run_js(f"MBE.attainment({json.dumps(run)}, {json.dumps(slo)})", "latency.js")
        assert met == pytest.approx(row["steady_slo_attainment"], rel=1e-5)
    # without a window (chapter 7), the share of every request
    run = dict(e.data["cells"]["1"][0], window=None)
    met = run_js(f"MBE.attainment({json.dumps(run)}, {json.dumps(slo)})", "latency.js")
    want = np.mean([t is not None and t <= slo["ttft"] and (p is None or p <= slo["tpot"])
                    for t, p in zip(run["ttft"], run["tpot"])])
    assert met == pytest.approx(want, rel=1e-12)


def test_policy_latency_checks_are_the_group_summary():
    from minibatch_engine.book.explorables import policy_latency
    from minibatch_engine.book.policy_runs import by_group, simulate
    from minibatch_engine.harness.workload import make_workload
    specs = make_workload("mixed-classes", 40, seed=0, arrival_rate=16)
    runs = {p: (simulate(specs, p), specs) for p in ("fcfs", "priority")}
    stats = {p: by_group(*run[0], specs) for p, run in runs.items()}
    e = policy_latency(runs, "mixed-classes", stats=stats)
    interactive = e.data["cells"]["0"]
    for chk in e.checks:
        if chk["set"] == {"class": 0, "percentile": 99}:
            for run in interactive:
                ttft = sorted(x for x in run["ttft"] if x is not None)
                assert np.percentile(ttft, 99) == pytest.approx(chk["expect"][f"{run['key']}-ttft"], rel=1e-5)
    assert e.data["cell_slo"]["0"] == {"ttft": 250.0, "e2el": 1000.0}
    with pytest.raises(ValueError, match="not a class workload"):
        policy_latency(runs, "chat")


def test_block_runs_record_what_the_manager_counts():
    from minibatch_engine import SamplingParams
    from minibatch_engine.book.explorables import block_explorer, block_run
    four = block_run(None, [[1] * 5, [2] * 2, [3] * 7], SamplingParams(max_tokens=6, ignore_eos=True),
                     block_size=2, num_kv_blocks=32, max_num_seqs=4, max_model_len=32, **SIM)
    fork = block_run(None, [list(range(1, 39))], SamplingParams(max_tokens=8, n=4, ignore_eos=True),
                     block_size=16, num_kv_blocks=24, max_num_seqs=4, max_model_len=64, **SIM)
    assert fork["cow_total"] == 3          # every sample but the last writer copies the shared block
    e = block_explorer({"four": four, "fork": fork})
    assert {c["set"]["variant"] for c in e.checks} == {0, 1}
    if NODE is None:
        return
    for v in (four, fork):
        got = run_js(f"{json.dumps(v['steps'])}.map(MBE.blockCounts)", "blocks.js")
        assert [(g["blocks"], g["tokens"]) for g in got] == [(c["blocks"], c["tokens"]) for c in v["counts"]]
    assert max(g["shared"] for g in run_js(f"{json.dumps(fork['steps'])}.map(MBE.blockCounts)",
                                           "blocks.js")) >= 2
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        block_run(None, [[1], [2]], [SamplingParams()], **SIM)
