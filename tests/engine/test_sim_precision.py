"""The simulator prices the KV cache and the weights by their bytes (issue 40):
``auto`` is the bf16 model it always was, an fp8/int8 KV cache halves the KV
bytes each decode reads, fp8/int4 projection weights cut the weight bytes."""
import pytest

from minibatch_engine import Engine, SamplingParams
from minibatch_engine.model.config import get_preset
from minibatch_engine.sim import CostModel, RooflineCostModel, get_gpu
from minibatch_engine.sim.calibration import default_calibration
from minibatch_engine.sim.operators import gemm_time
from minibatch_engine.sim.precision import (INT4_GROUP_SIZE, kv_bytes_per_element, projection_parameters,
                                            weight_bytes)

H100, L8B = get_gpu("H100-SXM"), get_preset("llama-3-8b")
DECODES = [(1, 4096)] * 64


def test_auto_prices_bf16_as_before():
    """``auto`` is bf16 everywhere: the GEMM's memory term and the attention
    kernel's KV bytes are the formulas of the bf16-only simulator, written out."""
    cal = default_calibration()
    M, N, K = 8, 6144, 4096
    t_c = 2 * M * N * K / (H100.peak_flops * cal.e_compute)
    t_m = 2 * (M * K + K * N + M * N) / (H100.hbm_bandwidth * cal.e_memory)
    assert gemm_time(M, N, K, H100, cal) == (t_c ** cal.p + t_m ** cal.p) ** (1 / cal.p) + cal.t0_s
    cm = CostModel(H100, L8B)
    kv_layer = 2 * L8B.num_kv_heads * L8B.head_dim * 2
    expect = sum(n * kv_layer / (H100.hbm_bandwidth * cal.attention_e_memory) for _, n in DECODES) + cal.t0_s
    assert cm.attention_seconds(DECODES) == pytest.approx(expect, rel=1e-12)
    assert cm.weight_bytes == L8B.num_parameters() * 2
    explicit = CostModel(H100, L8B, kv_cache_dtype="auto", weight_dtype="auto")
    assert explicit.step_cost(DECODES).seconds == cm.step_cost(DECODES).seconds


def test_an_auto_simulation_is_the_default_one():
    """A whole simulated run with the dtypes named ``auto`` is step for step
    the run with them left out."""
    def run(**dtypes):
        eng = Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b", max_num_seqs=64, **dtypes)
        for i in range(96):
            eng.add_request([1] * (64 + 7 * i), SamplingParams(max_tokens=40 + i % 9, ignore_eos=True))
        eng.run()
        return [(s.sim_end, s.num_scheduled, s.computed_tokens) for s in eng.trace.steps]
    assert run(sim_weight_dtype="auto") == run()


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_a_one_byte_kv_cache_halves_the_kv_bytes_a_decode_reads(dtype):
    """One byte a value instead of two, plus a float32 scale per token and KV
    head: (128 + 4) / 256 of the bytes at head_dim 128."""
    auto, small = CostModel(H100, L8B), CostModel(H100, L8B, kv_cache_dtype=dtype)
    assert kv_bytes_per_element(dtype) == 1
    ratio = (L8B.head_dim + 4) / (2 * L8B.head_dim)
    assert small.roofline.kv_bytes_per_token == auto.roofline.kv_bytes_per_token * ratio
    # the roofline's bytes: the same weights, the K/V read and written in `ratio` of the bytes
    weights = auto.roofline.weight_bytes
    assert small.step_cost(DECODES).bytes - weights == (auto.step_cost(DECODES).bytes - weights) * ratio
    # the attention kernel of a memory-bound decode: `ratio` of the time above its fixed cost
    t0 = auto.cal.t0_s
    assert small.attention_seconds(DECODES) - t0 == pytest.approx((auto.attention_seconds(DECODES) - t0) * ratio)
    assert small.step_cost(DECODES).seconds < auto.step_cost(DECODES).seconds


@pytest.mark.parametrize("dtype", ["auto", "fp8", "int8"])
def test_the_simulator_prices_the_bytes_its_kv_pool_holds(dtype):
    eng = Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b", kv_cache_dtype=dtype)
    assert eng.cost_model.kv_cache_dtype == dtype
    assert eng.kv_cache.bytes_per_token == eng.cost_model.roofline.kv_bytes_per_token


def test_weight_dtype_prices_the_projection_bytes():
    proj = projection_parameters(L8B)
    rest = L8B.num_parameters() - proj
    assert weight_bytes(L8B, "fp8") == proj + 2 * rest
    assert weight_bytes(L8B, "int4") == pytest.approx(proj * (0.5 + 4 / INT4_GROUP_SIZE) + 2 * rest, abs=1)
    auto, fp8, int4 = (CostModel(H100, L8B, weight_dtype=w) for w in ("auto", "fp8", "int4"))
    assert fp8.weight_bytes == weight_bytes(L8B, "fp8") and int4.weight_bytes < fp8.weight_bytes
    one = [(1, 512)]            # a lone decode: the projections read their weights, little else
    p = {m.weight_dtype: m.gpu_seconds(one)["projections"] for m in (auto, fp8, int4)}
    assert p["int4"] < p["fp8"] < p["auto"]
    assert 0.5 < p["fp8"] / p["auto"] < 0.6     # weight bytes dominate at M = 1; each GEMM's fixed cost stays
    # a large prefill is compute-bound: priced at the bf16 FLOP rate, fewer bytes barely help
    big = [(4096, 4096)]
    assert fp8.gpu_seconds(big)["projections"] / auto.gpu_seconds(big)["projections"] > 0.95


def test_fp8_weights_leave_more_memory_for_kv():
    auto = Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b", max_num_seqs=4096)
    fp8 = Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b", max_num_seqs=4096, sim_weight_dtype="fp8")
    freed = weight_bytes(L8B) - weight_bytes(L8B, "fp8")
    assert fp8.kv_cache.capacity_bytes - auto.kv_cache.capacity_bytes == pytest.approx(freed, rel=1e-3)


def test_unknown_dtypes_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        CostModel(H100, L8B, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="sim_weight_dtype='int3' is not one of"):
        Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b", sim_weight_dtype="int3")
    assert isinstance(RooflineCostModel(H100, L8B, weight_bytes=1).weight_bytes, int)
