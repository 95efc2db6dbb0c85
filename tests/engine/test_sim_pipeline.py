"""Pipeline parallelism in the simulator (issue 42): layers in stages, the
schedule of micro-batches and its bubble, the hand-over priced from the
measured send/recv, weights and KV spread over the stages, and nothing of it
changes a run's tokens or a one-stage run's clock."""
import csv
import json
from pathlib import Path

import numpy as np
import pytest

from minibatch_engine import Engine, EngineConfig, SamplingParams, reference_generate
from minibatch_engine.entrypoints.cli import main
from minibatch_engine.model.config import get_preset
from minibatch_engine.sim import CostModel, get_gpu
from minibatch_engine.sim.calibration import CALIBRATION_FILE, default_calibration
from minibatch_engine.sim.operators import all_reduce_time, send_recv_time
from minibatch_engine.sim.pipeline import (gpipe_bubble_fraction, handover_crosses_nodes, pipeline_time,
                                           split_microbatches, stage_layers)

from ..conftest import sim_engine

ROOT = Path(__file__).resolve().parents[2]
SEND_RECV = ROOT / "data" / "gpu-profiles" / "network" / "h100_dgx" / "send_recv.csv"
H100, L8B, L70B = get_gpu("H100-SXM"), get_preset("llama-3-8b"), get_preset("llama-3-70b")
DECODES = [(1, 2048)] * 256
BANDS = (("under 1 MiB", 0, 2**20), ("1-8 MiB", 2**20, 2**23), ("8 MiB and more", 2**23, np.inf))


def measured_send_recv() -> dict[bool, tuple[np.ndarray, np.ndarray]]:
    """across nodes? -> (bytes, measured seconds) of the committed CSV."""
    rows = list(csv.DictReader(open(SEND_RECV, newline="")))
    out = {}
    for across in (True, False):
        sel = [r for r in rows if (r["devices_per_node"] == "1") == across]
        out[across] = (np.array([float(r["size"]) for r in sel]),
                       np.array([float(r["time_stats.send_recv.median"]) * 1e-3 for r in sel]))
    return out


# --- the schedule ---------------------------------------------------------------------------
@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_gpipe_bubble_is_pp_minus_one_over_m_plus_pp_minus_one(pp, m):
    timing = pipeline_time([[0.01] * m] * pp, schedule="gpipe")
    assert timing.seconds == pytest.approx(0.01 * (m + pp - 1))
    assert timing.bubble_fraction == pytest.approx(gpipe_bubble_fraction(pp, m)) == pytest.approx(
        (pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_steady_state_has_no_bubble_once_every_stage_has_a_micro_batch(pp, m):
    """Micro-batches kept in flight: with m >= pp the busiest stage binds and no
    GPU idles; with fewer, each round trip leaves a share 1 - m / pp idle."""
    timing = pipeline_time([[0.01] * m] * pp)
    assert timing.seconds == pytest.approx(0.01 * max(m, pp))
    assert timing.bubble_fraction == pytest.approx(max(0.0, 1 - m / pp), abs=1e-9)


def test_hand_overs_cost_time_only_when_a_stage_waits_for_one():
    pp, t, h, r = 4, 0.01, 0.001, 0.0005
    assert pipeline_time([[t] * pp] * pp, [[h] * pp] * (pp - 1), [r] * pp).seconds == pytest.approx(
        pp * t + (pp - 1) * h + r)                        # m = pp: the round trip binds
    assert pipeline_time([[t] * 8] * pp, [[h] * 8] * (pp - 1), [r] * 8).seconds == pytest.approx(8 * t)
    assert pipeline_time([[t]] * pp, [[h]] * (pp - 1), [r], schedule="gpipe").seconds == pytest.approx(
        pp * t + (pp - 1) * h + r)


def test_layers_split_evenly_the_remainder_before_the_last_stage():
    # the uneven cases vLLM's own tests of get_pp_indices list (tests/distributed/test_pipeline_partition.py)
    assert [stage_layers(n, pp) for n, pp in ((3, 2), (4, 3), (5, 3))] == [(2, 1), (1, 2, 1), (2, 2, 1)]
    assert stage_layers(80, 4) == (20, 20, 20, 20)
    assert stage_layers(80, 3) == (27, 27, 26)
    assert stage_layers(10, 4) == (2, 3, 3, 2)
    assert stage_layers(81, 2) == (41, 40)
    assert sum(stage_layers(61, 8)) == 61


def test_micro_batches_balance_tokens_and_keep_every_sequence():
    shapes = [(512, 512)] + [(1, 100 + i) for i in range(9)] + [(256, 1024)]
    batches = split_microbatches(shapes, 3)
    assert sorted(s for b in batches for s in b) == sorted(shapes)
    assert len(batches) == 3 and max(sum(q for q, _ in b) for b in batches) == 512
    assert len(split_microbatches([(1, 10)], 4)) == 1


def test_stages_sit_in_order_on_eight_gpu_nodes():
    assert [handover_crosses_nodes(s, 2, 8) for s in range(7)] == [False, False, False, True, False, False, False]
    assert handover_crosses_nodes(0, 8, 8) and not handover_crosses_nodes(0, 4, 8)


# --- the cost model ----------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("shapes", [[(1, 1024)], DECODES, [(2048, 2048)], DECODES[:64] + [(512, 512)]])
def test_one_stage_is_the_step_as_before(tp, shapes):
    """pp = 1 takes the unpipelined path: its parts, the step and a one-stage
    pipeline timing all agree, with no hand-over and no bubble."""
    one, default = CostModel(H100, L70B, tp, pipeline_parallel_size=1), CostModel(H100, L70B, tp)
    assert one.step_time(shapes) == default.step_time(shapes)
    assert one.gpu_seconds(shapes) == default.gpu_seconds(shapes)
    timing = one.pipeline_timing(shapes)
    assert timing.seconds == pytest.approx(sum(one.gpu_seconds(shapes).values()), rel=1e-12)
    assert timing.handover_seconds == () and timing.bubble_fraction == pytest.approx(0, abs=1e-12)


def test_a_one_stage_run_is_todays_run_step_for_step():
    runs = []
    for options in ({}, {"pipeline_parallel_size": 1}):
        engine = sim_engine(sim_model="llama-3-70b", tensor_parallel_size=4, **options)
        for i in range(6):
            engine.add_request([1] * (50 + 40 * i), SamplingParams(max_tokens=20, ignore_eos=True),
                               arrival_time=0.01 * i)
        engine.run()
        runs.append(([(s.sim_start, s.sim_end) for s in engine.trace.steps],
                     [r.output_token_ids for r in engine.requests.values()]))
    assert runs[0] == runs[1] and len(runs[0][0]) > 20


def test_the_hand_over_follows_the_measured_send_recv_within_the_stated_error():
    """Every row of the measured CSV, within a node and across nodes, is within
    the error calibration.json states for its size band, and those are small
    from 1 MiB on (a few percent at the median)."""
    stated = json.loads(CALIBRATION_FILE.read_text())["errors"]["send/recv"]
    for across, (size, seconds) in measured_send_recv().items():
        err = np.abs(send_recv_time(size, H100, across) / seconds - 1)
        for label, lo, hi in BANDS:
            band = err[(size >= lo) & (size < hi)]
            s = stated[f"{'across nodes' if across else 'within a node'}, {label}"]
            assert np.median(band) == pytest.approx(s["median"], abs=1e-4)
            assert np.percentile(band, 90) == pytest.approx(s["p90"], abs=1e-4)
            if lo >= 2**20:
                assert s["median"] < 0.05 and s["p90"] < 0.16


@pytest.mark.parametrize("tp, across", [(1, False), (8, True)])
def test_the_cost_models_hand_over_is_the_fit_at_the_activations_bytes(tp, across):
    """A 1024-token prefill on two stages hands over the hidden states and the
    residual, [1024, 8192] each in bf16 (32 MiB): within a node with tp = 1; with
    tp = 8 each of the 8 pairs sends 1/8 across nodes and the stage all-gathers.
    The send is within the band's stated p90 of the nearest measured row."""
    cm = CostModel(H100, L70B, tensor_parallel_size=tp, pipeline_parallel_size=2)
    nbytes = 2 * 1024 * 8192 * 2
    (handover,) = cm.pipeline_timing([(1024, 1024)]).handover_seconds
    send = send_recv_time(nbytes / tp, H100, across)
    assert handover == pytest.approx(send + all_reduce_time(nbytes, tp, H100) / 2)
    size, seconds = measured_send_recv()[across]
    nearest = np.argmin(np.abs(size - nbytes / tp))
    stated = json.loads(CALIBRATION_FILE.read_text())["errors"]["send/recv"]
    band = next(label for label, lo, hi in BANDS if lo <= size[nearest] < hi)
    assert abs(send / seconds[nearest] - 1) <= stated[f"{'across nodes' if across else 'within a node'}, {band}"]["p90"]


def test_only_the_boundary_between_nodes_goes_over_the_network():
    cm = CostModel(H100, L70B, tensor_parallel_size=2, pipeline_parallel_size=8)
    h = cm.pipeline_timing([(512, 512)]).handover_seconds
    assert h[3] > 3 * max(h[:3] + h[4:]) and len(set(h[:3] + h[4:])) == 1


def test_the_engine_bubble_is_large_for_one_sequence_and_small_for_a_full_batch():
    cm = CostModel(H100, L70B, tensor_parallel_size=2, pipeline_parallel_size=4)
    assert cm.pipeline_timing([(1, 2048)]).bubble_fraction > 0.7           # one micro-batch: (pp - 1) / pp
    assert cm.pipeline_timing(DECODES).bubble_fraction < 0.1
    cost = cm.step_cost(DECODES)
    assert sum(cost.parts.values()) == pytest.approx(cost.seconds)
    assert cost.parts["pipeline bubble"] > 0
    gpipe = cm.pipeline_timing(DECODES, microbatches=4, schedule="gpipe")
    assert gpipe.seconds > cm.pipeline_timing(DECODES).seconds           # fill and drain every step


def test_weights_per_gpu_shrink_with_stages_and_kv_memory_is_all_gpus():
    usable = 0.9 * H100.memory_bytes
    per_gpu = [CostModel(H100, L70B, pipeline_parallel_size=pp).weight_bytes_per_gpu for pp in (1, 2, 4, 8)]
    assert per_gpu == sorted(per_gpu, reverse=True)
    head = L70B.vocab_size * L70B.hidden_size * 2
    for pp, w in zip((1, 2, 4, 8), per_gpu):
        cm = CostModel(H100, L70B, pipeline_parallel_size=pp)
        assert sum(cm.stage_weight_bytes) == pytest.approx(cm.weight_bytes)
        assert cm.weight_bytes / pp <= w + 1 <= cm.weight_bytes / pp + head + 1
    four = CostModel(H100, L70B, tensor_parallel_size=2, pipeline_parallel_size=4)
    kv = four.kv_memory_bytes(usable)
    assert kv <= 8 * usable - four.weight_bytes and kv == pytest.approx(8 * usable - four.weight_bytes, rel=0.01)
    small = sim_engine(sim_model="llama-3-70b", tensor_parallel_size=4, max_num_seqs=1024)
    big = sim_engine(sim_model="llama-3-70b", tensor_parallel_size=4, pipeline_parallel_size=2, max_num_seqs=1024)
    assert 0 < small.kv_cache.capacity_bytes < big.kv_cache.capacity_bytes


def test_pipeline_beats_tensor_parallelism_across_nodes_but_not_on_latency():
    """16 GPUs in two nodes: TP 16 all-reduces twice per layer over the network
    (extrapolated: no cross-node all-reduce was measured), TP 8 x PP 2 sends one
    activation across. A full decode batch is much faster on the pipeline; a
    lone sequence is no faster than on TP 8 alone (it goes through both stages)."""
    tp16 = CostModel(H100, L70B, tensor_parallel_size=16)
    pipe = CostModel(H100, L70B, tensor_parallel_size=8, pipeline_parallel_size=2)
    tp8 = CostModel(H100, L70B, tensor_parallel_size=8)
    assert pipe.step_time(DECODES) < 0.5 * tp16.step_time(DECODES)
    assert pipe.step_time([(1, 2048)]) >= tp8.step_time([(1, 2048)])
    alpha8 = default_calibration().all_reduce[8][0]
    alpha_net, network = default_calibration().send_recv["across_nodes"]
    ring = 2 * 15 / 16 * 1e6 / network                   # the ring's traffic at the measured network speed
    assert all_reduce_time(1e6, 16, H100, gpus_per_node=8) == pytest.approx(alpha8 + alpha_net + ring)


# --- tokens, and what is refused --------------------------------------------------------------
def test_a_greedy_runs_tokens_do_not_depend_on_the_stages(tiny64):
    prompts = [[1, 2, 3], list(range(10, 30)), [5] * 9]
    runs = []
    for pp in (1, 2, 4):
        engine = Engine(tiny64, max_num_seqs=2, max_model_len=64, sim_gpu="H100-SXM", sim_model="llama-3-8b",
                        pipeline_parallel_size=pp)
        reqs = [engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
        engine.run()
        runs.append([r.output_token_ids for r in reqs])
    assert runs[0] == runs[1] == runs[2] == [reference_generate(tiny64, p, 10) for p in prompts]


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True, None])
def test_bad_stage_counts_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        EngineConfig(pipeline_parallel_size=bad)


def test_stages_need_the_simulator_layers_and_no_draft_model(tiny64):
    with pytest.raises(ValueError, match="pipeline parallelism is simulated only.*needs sim_gpu"):
        Engine(tiny64, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size 33 exceeds the model's 32 layers"):
        sim_engine(pipeline_parallel_size=33)
    with pytest.raises(ValueError, match=r"fullest of 2 H100-SXM.*4 or more GPUs would fit them"):
        sim_engine(sim_model="llama-3-70b", pipeline_parallel_size=2, gpu_memory_utilization=0.5)
    from minibatch_engine.speculative.config import SpeculativeConfig
    with pytest.raises(ValueError, match="draft model is not simulated"):
        sim_engine(pipeline_parallel_size=2, speculative=SpeculativeConfig("draft_model", 3))
    with pytest.raises(ValueError, match="schedule must be one of steady, gpipe"):
        pipeline_time([[1.0]], schedule="1f1b")
    with pytest.raises(ValueError, match=r"handover_seconds must be a \[1\]\[2\] table"):
        pipeline_time([[1.0, 1.0]] * 2, [[0.1]])
    with pytest.raises(ValueError, match="microbatches must be a positive integer"):
        CostModel(H100, L8B, pipeline_parallel_size=2).pipeline_timing(DECODES, microbatches=0)


def test_simulate_with_pipeline_parallelism(capsys):
    """--pp splits a model across stages; a count beyond its layers is a usage error naming --pp."""
    assert main(["simulate", "--sim-model", "llama-3-70b", "--tp", "4", "--pp", "2", "--num-requests", "4",
                 "--max-batch", "4", "--no-progress"]) == 0
    assert main(["simulate", "--sim-model", "llama-3-70b", "--pp", "81", "--num-requests", "4",
                 "--no-progress"]) == 2
    assert "--pp 81 exceeds the model's 80 layers" in capsys.readouterr().err
