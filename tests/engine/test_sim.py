"""The roofline simulator: which resource binds, and determinism."""
import pytest

from minibatch_engine import Engine, EngineConfig, SamplingParams
from minibatch_engine.model.config import get_preset
from minibatch_engine.sim import RooflineCostModel, get_gpu


@pytest.fixture
def h100_8b():
    return RooflineCostModel(get_gpu("H100-SXM"), get_preset("llama-3-8b"))


def test_gpu_names_are_case_blind_and_unknown_ones_refused():
    assert get_gpu("h100-sxm") is get_gpu("H100-SXM")
    with pytest.raises(ValueError, match="unknown GPU"):
        get_gpu("TPU")


def test_decode_is_memory_bound_and_big_prefill_compute_bound(h100_8b):
    assert h100_8b.step_cost([(1, 512)] * 8).bound == "memory"
    assert h100_8b.step_cost([(4096, 4096)]).bound == "compute"


def test_decode_step_time_is_about_weights_over_bandwidth(h100_8b):
    cost = h100_8b.step_cost([(1, 1)])
    weights = get_preset("llama-3-8b").num_parameters() * 2
    assert cost.seconds == pytest.approx(weights / 3.35e12 + 1e-3, rel=1e-3)


def test_batching_decode_is_nearly_free_until_the_ridge(h100_8b):
    one = h100_8b.step_time([(1, 128)])
    many = h100_8b.step_time([(1, 128)] * 32)
    assert many < 1.2 * one                      # 32x the tokens for < 20% more time
    assert h100_8b.step_time([(1, 128)] * 64) > one


def test_flops_count_for_a_prefill(h100_8b):
    cfg = get_preset("llama-3-8b")
    q = 100
    flops = h100_8b.step_cost([(q, q)]).flops
    linear = 2 * cfg.num_parameters(include_embeddings=False) * q
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * q * (q + 1) // 2
    head = 2 * cfg.hidden_size * cfg.vocab_size
    assert flops == linear + attn + head


def test_simulated_run_is_deterministic_and_needs_no_model():
    def run():
        e = Engine(None, EngineConfig(max_num_seqs=4, sim_gpu="H100-SXM", sim_model="llama-2-7b"))
        for p, g in [(10, 5), (200, 30), (50, 1), (7, 7), (100, 12)]:
            e.add_request([1] * p, SamplingParams(max_tokens=g, ignore_eos=True))
        e.run()
        return [s.sim_end for s in e.trace.steps]
    a, b = run(), run()
    assert a == b and all(x < y for x, y in zip(a, a[1:]))


def test_poisson_arrivals_on_the_sim_clock():
    e = Engine(None, EngineConfig(max_num_seqs=4, sim_gpu="H100-SXM", sim_model="llama-3-8b"))
    late = e.add_request([1] * 8, SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=5.0)
    early = e.add_request([1] * 8, SamplingParams(max_tokens=2, ignore_eos=True))
    e.run()
    assert early.finish_step < late.first_scheduled_step
    assert e.trace[late.first_scheduled_step].sim_start >= 5.0
    assert late.arrival_time["sim"] == 5.0


def test_engine_without_model_needs_simulator():
    with pytest.raises(ValueError, match="sim_gpu"):
        Engine(None, EngineConfig())
