"""The simulator's per-operator model (issue 26): its constants come from the
measured profiles by a committed script, it predicts them within the stated
error, and its public function refuses what it cannot price."""
import importlib.util
import json
from pathlib import Path

import pytest

from minibatch_engine.model.config import get_preset
from minibatch_engine.sim import op_times
from minibatch_engine.sim.calibration import CALIBRATION_FILE
from minibatch_engine.sim.operators import LAYER_OPS, all_reduce_time, check_tensor_parallel, gemm_time
from minibatch_engine.sim.hardware import get_gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def refit():
    """tools/calibrate_sim.py run afresh on data/gpu-profiles (about 3 s)."""
    spec = importlib.util.spec_from_file_location("calibrate_sim", ROOT / "tools" / "calibrate_sim.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool, tool.calibrate(tool.DATA)


def test_the_committed_constants_are_what_the_script_fits(refit):
    tool, result = refit
    stored = json.loads(CALIBRATION_FILE.read_text())
    assert tool.flatten(tool.fitted_constants(stored)) == pytest.approx(
        tool.flatten(tool.fitted_constants(result)), rel=1e-3)
    assert stored["provenance"]["files"] == result["provenance"]["files"]     # same inputs, by sha256


def test_projections_within_the_stated_error_on_seen_and_unseen_data(refit):
    """Median <= 8% and 90th percentile <= 20% over 1-4096 tokens and TP 1-8, on the
    calibration set and on a GPU the fit never saw (both directions); the ideal
    roofline, by contrast, is far off. Across shapes (fitted on Llama-2-7B, checked
    on phi-2) the 90th percentile is 21%: stated here, not hidden."""
    _, result = refit
    e = result["errors"]["projections"]
    for name in ("calibration set", "fitted on H100, checked on A100", "fitted on A100, checked on H100"):
        assert e[name]["median"] <= 0.08 and e[name]["p90"] <= 0.20, (name, e[name])
    shape = e["fitted on Llama-2-7B (H100), checked on phi-2 (H100)"]
    assert shape["median"] <= 0.08 and shape["p90"] <= 0.22
    assert e["ideal roofline (no constant fitted)"]["median"] > 0.3


def test_op_times_prices_every_operator_of_a_layer():
    t = op_times("H100-SXM", "llama-3-8b", 512)
    assert list(t) == list(LAYER_OPS) and all(v > 0 for v in t.values())
    more = op_times("H100-SXM", "llama-3-8b", 4096)
    assert all(more[op] > t[op] for op in LAYER_OPS)                 # more tokens never cost less
    assert op_times("A100-80GB", "llama-3-8b", 512)["mlp_up_proj"] > t["mlp_up_proj"]
    # a slow GPU is not in the profiles' names: any GPU preset and any ModelConfig work
    assert op_times(get_gpu("H200"), get_preset("llama-3-70b"), 1, tp=8)["attn_pre_proj"] > 0
    assert op_times("H100-SXM", "gpt2", 8)["attn_rope"] == 0         # learned positions: no RoPE


def test_tensor_parallel_shards_the_projections():
    """At a compute-bound size each GPU's shard takes about 1/tp of the time."""
    one = op_times("H100-SXM", "llama-3-70b", 4096)["mlp_up_proj"]
    eight = op_times("H100-SXM", "llama-3-70b", 4096, tp=8)["mlp_up_proj"]
    assert one / 8 < eight < one / 6


def test_all_reduce_costs_nothing_alone_and_grows_with_bytes_and_a_slower_link():
    h100, a100 = get_gpu("H100-SXM"), get_gpu("A100-80GB")
    assert all_reduce_time(2**20, 1, h100) == 0
    assert 0 < all_reduce_time(2**20, 8, h100) < all_reduce_time(2**24, 8, h100)
    assert all_reduce_time(2**24, 8, a100) > all_reduce_time(2**24, 8, h100)


@pytest.mark.parametrize("args, match", [
    (("B200", "llama-3-8b", 8), "unknown GPU"),
    (("H100-SXM", "llama-9", 8), "unknown model preset"),
    (("H100-SXM", "llama-3-8b", 0), "num_tokens"),
    (("H100-SXM", "llama-3-8b", 2.5), "num_tokens"),
])
def test_op_times_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        op_times(*args)


def test_tensor_parallel_size_must_divide_the_model():
    check_tensor_parallel(get_preset("llama-3-8b"), 8)
    with pytest.raises(ValueError, match="does not divide"):
        check_tensor_parallel(get_preset("llama-3-8b"), 3)
    with pytest.raises(ValueError, match="positive integer"):
        check_tensor_parallel(get_preset("llama-3-8b"), 0)


def test_gemm_time_is_never_below_the_ideal_roofline():
    gpu = get_gpu("H100-SXM")
    for M in (1, 16, 256, 4096):
        ideal = max(2 * M * 4096 * 4096 / gpu.peak_flops, 2 * (2 * M * 4096 + 4096 * 4096) / gpu.hbm_bandwidth)
        assert gemm_time(M, 4096, 4096, gpu) > ideal
