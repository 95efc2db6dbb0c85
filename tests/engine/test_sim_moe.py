"""Mixture of experts in the simulator (issue 42, item 3): published shapes and
their parameter counts, the experts a step touches, expert parallelism's
all-to-all and load imbalance, and what never changes (dense models' step
times, a run's tokens)."""
import numpy as np
import pytest

from minibatch_engine import Engine, SamplingParams, reference_generate
from minibatch_engine.model.config import PRESETS, ModelConfig, get_preset
from minibatch_engine.model.transformer import Transformer
from minibatch_engine.sim import CostModel, get_gpu
from minibatch_engine.sim.moe import all_to_all_time, expected_experts_touched, expert_bytes_read
from minibatch_engine.sim.moe_decode import compute_bound_batch, decode_profile
from minibatch_engine.sim.operators import gemm_time, layer_op_time, projection_shape, small_op_time

from ..conftest import sim_engine

H100 = get_gpu("H100-SXM")
MIXTRAL = get_preset("mixtral-8x7b")

# (preset, published total, published active, relative tolerance on each):
# the model cards round to three significant digits (Qwen3-30B-A3B's 3.3B active to two);
# deepseek-v3-like stands GQA in for MLA (its config comment: +0.5% total, +10% active)
PUBLISHED = [("mixtral-8x7b", 46.7e9, 12.9e9, 0.01, 0.01),
             ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.01, 0.02),
             ("qwen3-235b-a22b", 235e9, 22e9, 0.01, 0.01),
             ("deepseek-v3-like", 671e9, 37e9, 0.01, 0.12)]


@pytest.mark.parametrize("name,total,active,tol_total,tol_active", PUBLISHED)
def test_presets_match_the_published_parameter_counts(name, total, active, tol_total, tol_active):
    cfg = get_preset(name)
    assert cfg.total_parameters == pytest.approx(total, rel=tol_total)
    assert cfg.active_parameters == pytest.approx(active, rel=tol_active)


def test_a_dense_models_active_parameters_are_its_total():
    for cfg in PRESETS.values():
        if not cfg.is_moe:
            assert cfg.active_parameters == cfg.total_parameters == cfg.num_parameters()


def test_distinct_experts_formula_matches_a_seeded_monte_carlo():
    rng = np.random.default_rng(0)
    for E, k, B, trials in [(8, 2, 1, 400), (8, 2, 4, 400), (8, 2, 16, 400), (128, 8, 8, 300), (256, 8, 64, 100)]:
        # each token picks k distinct experts uniformly (the k smallest of E random keys)
        picks = np.argpartition(rng.random((trials, B, E)), k - 1, axis=-1)[..., :k]
        touched = np.array([np.unique(p).size for p in picks.reshape(trials, -1)])
        se = touched.std() / np.sqrt(trials) + 1e-9
        assert abs(touched.mean() - expected_experts_touched(E, k, B)) < 4 * se + 1e-6, (E, k, B)
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2)             # one token: exactly its k experts
    assert expected_experts_touched(256, 8, 4096) == pytest.approx(256)      # a big batch touches them all


def test_a_dense_models_step_is_todays_sum_of_operators():
    """The dense path is the operators in execution order, as before experts
    existed: rebuilt here from the operator functions, it matches exactly."""
    for model, tp in ((get_preset("llama-3-8b"), 1), (get_preset("llama-3-70b"), 4)):
        cm = CostModel(H100, model, tensor_parallel_size=tp, expert_parallel_size=1)
        for tokens in (1, 64, 700):
            projections = sum(gemm_time(tokens, N, K, H100, cm.cal, 2.0)
                              for K, N in (projection_shape(op, model, tp) for op in
                                           ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")))
            small = sum(layer_op_time(op, model, tokens, tp, H100, cm.cal) for op in
                        ("input_layernorm", "post_attention_layernorm", "mlp_act", "add", "add", "attn_rope"))
            small += small_op_time("kv_write", tokens * cm.kv_bytes_per_token_layer * 2, H100, cm.cal)
            parts = cm.gpu_seconds([(tokens, 1024)])
            assert parts["projections"] == model.num_layers * projections
            assert parts["small operators"] == model.num_layers * small
            assert "experts" not in parts and "all-to-all" not in parts


def test_a_one_expert_moe_costs_what_the_dense_model_does_plus_its_router():
    dense = get_preset("llama-3-8b")
    one = dense.with_(name="one-expert", num_experts=1, num_experts_per_tok=1,
                      moe_intermediate_size=dense.intermediate_size)
    assert one.total_parameters == dense.total_parameters + dense.num_layers * dense.hidden_size
    shapes = [(1, 512)] * 16 + [(200, 200)]
    d, m = CostModel(H100, dense).gpu_seconds(shapes), CostModel(H100, one).gpu_seconds(shapes)
    act = dense.num_layers * layer_op_time("mlp_act", dense, 216, 1, H100)      # moved into "experts"
    assert m["projections"] + m["experts"] == pytest.approx(d["projections"] + act, rel=1e-9)
    assert m["small operators"] + act == pytest.approx(d["small operators"], rel=1e-9)
    assert m["attention"] == d["attention"] and m["router"] > 0 and m["shared experts"] == 0


def test_decode_reads_k_experts_at_batch_one_and_all_of_them_at_large_batch():
    cm = CostModel(H100, MIXTRAL, tensor_parallel_size=2)
    kv = cm.kv_bytes_per_token                  # shapes (1, 1): each sequence writes one token's KV, reads none
    flops_1, bytes_1 = cm.roofline.flops_and_bytes([(1, 1)])
    assert bytes_1 - kv == pytest.approx(MIXTRAL.active_parameters * 2, rel=1e-3)
    flops_b, bytes_b = cm.roofline.flops_and_bytes([(1, 1)] * 512)
    assert bytes_b - 512 * kv == pytest.approx(MIXTRAL.total_parameters * 2, rel=1e-3)
    # FLOPs per token follow the active parameters, whatever the batch
    assert flops_b == 512 * flops_1
    m = MIXTRAL
    assert flops_1 == (2 * m.num_parameters(include_embeddings=False, routed_experts=2)
                       + 4 * m.num_layers * m.num_heads * m.head_dim + 2 * m.hidden_size * m.vocab_size)


def test_decode_profile_memory_bound_on_total_weights_and_compute_light():
    rows = decode_profile("mixtral-8x7b", "H100-SXM", (1, 8, 64, 512), context=256, tensor_parallel_size=2)
    share = [r["weights read / total"] for r in rows]
    assert share[0] < 0.3 and share[-1] > 0.99 and share == sorted(share)
    assert all(r["bound"] == "memory" for r in rows[:3])
    ms = [r["step ms"] for r in rows]
    assert ms == sorted(ms) and rows[-1]["tokens/s"] > 20 * rows[0]["tokens/s"]
    # compute-light: the same FLOPs per token at every batch, and past the point where
    # every expert is read, the MoE's FLOP per weight byte is active/total of a dense model's
    assert rows[-1]["GFLOP per token"] == pytest.approx(rows[0]["GFLOP per token"], rel=0.01)
    dense_like = decode_profile(MIXTRAL.with_(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                                              intermediate_size=8 * 14336, name="dense-46b"),
                                "H100-SXM", (512,), context=256, tensor_parallel_size=2)[0]
    ratio = rows[-1]["FLOP/weight byte"] / dense_like["FLOP/weight byte"]
    assert ratio == pytest.approx(MIXTRAL.active_parameters / MIXTRAL.total_parameters, rel=0.02)
    # so the MoE needs a bigger batch before its weights stop binding
    assert compute_bound_batch("mixtral-8x7b", "H100-SXM") > 3 * compute_bound_batch("llama-3-70b", "H100-SXM")


def test_expert_parallel_all_to_all_grows_with_tokens_and_vanishes_on_one_gpu():
    ep8 = CostModel(H100, MIXTRAL, expert_parallel_size=8)
    a2a = [ep8.gpu_seconds([(1, 512)] * b)["all-to-all"] for b in (1, 8, 64, 512)]
    assert all(x < y for x, y in zip(a2a, a2a[1:]))
    assert "all-to-all" not in CostModel(H100, MIXTRAL, tensor_parallel_size=2).gpu_seconds([(1, 512)])
    assert all_to_all_time(1e6, 1, H100) == 0
    # at batch 1 the busiest GPU holds one of the token's two experts and reads all of it
    d, f = MIXTRAL.hidden_size, MIXTRAL.moe_intermediate_size
    one_expert = MIXTRAL.num_moe_layers * (gemm_time(1, 2 * f, d, H100) + gemm_time(1, d, f, H100))
    assert ep8.gpu_seconds([(1, 512)])["experts"] >= one_expert
    assert all_to_all_time(2e6, 8, H100) > all_to_all_time(1e6, 8, H100) > 0


def test_load_imbalance_stretches_the_expert_phase_monotonically():
    shapes = [(1, 512)] * 64
    times = [CostModel(H100, MIXTRAL, expert_parallel_size=8, expert_load_imbalance=r).gpu_seconds(shapes)
             for r in (1.0, 1.25, 2.0, 4.0)]
    for key in ("experts", "all-to-all"):
        assert all(a[key] < b[key] for a, b in zip(times, times[1:]))
    assert all(a["attention"] == b["attention"] for a, b in zip(times, times[1:]))


def test_expert_parallel_shards_experts_and_copies_the_rest():
    ep8, tp8 = CostModel(H100, MIXTRAL, expert_parallel_size=8), CostModel(H100, MIXTRAL, tensor_parallel_size=8)
    routed = expert_bytes_read(MIXTRAL, float("inf"))
    assert ep8.resident_weight_bytes == pytest.approx(8 * (ep8.weight_bytes - routed) + routed)
    assert tp8.weight_bytes_per_gpu < ep8.weight_bytes_per_gpu < ep8.weight_bytes / 4
    # the engine's KV memory is all GPUs' memory less the weights they hold
    e = sim_engine(sim_model="mixtral-8x7b", expert_parallel_size=8, max_num_seqs=4096, max_model_len=32768)
    cap = int(8 * 0.9 * H100.memory_bytes - ep8.resident_weight_bytes)
    assert cap - 16 * e.kv_cache.bytes_per_token < e.kv_cache.capacity_bytes <= cap     # within one block


def test_a_runs_tokens_do_not_depend_on_experts_or_expert_parallelism(tiny64):
    prompts = [[1, 2, 3], list(range(10, 30)), [5] * 9]
    engine = Engine(tiny64, max_num_seqs=2, max_model_len=64, sim_gpu="H100-SXM", sim_model="mixtral-8x7b")
    reqs = [engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    engine.run()
    assert [r.output_token_ids for r in reqs] == [reference_generate(tiny64, p, 10) for p in prompts]
    runs = []
    for layout in (dict(tensor_parallel_size=2), dict(expert_parallel_size=8, expert_load_imbalance=2.0)):
        e = sim_engine(sim_model="mixtral-8x7b", max_num_seqs=4, **layout)
        rs = [e.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
        e.run()
        runs.append(([r.output_token_ids for r in rs], e.trace.steps[-1].sim_end))
    assert runs[0][0] == runs[1][0] and runs[0][1] != runs[1][1]


@pytest.mark.parametrize("options,message", [
    (dict(sim_model="llama-3-8b", expert_parallel_size=2), "needs a mixture-of-experts model; llama-3-8b is dense"),
    (dict(sim_model="mixtral-8x7b", expert_parallel_size=3), "does not divide mixtral-8x7b's 8 experts"),
    (dict(sim_model="mixtral-8x7b", tensor_parallel_size=2, expert_load_imbalance=1.5), "needs expert_parallel_size > 1"),
    (dict(sim_model="mixtral-8x7b", expert_parallel_size=2, expert_load_imbalance=3.0), "exceeds expert_parallel_size 2"),
    (dict(sim_model="mixtral-8x7b", expert_parallel_size=2, expert_load_imbalance=0.5), "expert_load_imbalance must"),
    (dict(sim_model="mixtral-8x7b", expert_parallel_size=2, tensor_parallel_size=2), "tensor_parallel_size 1"),
    (dict(sim_model="qwen3-30b-a3b", expert_parallel_size=16), "spans nodes"),
    (dict(sim_model="mixtral-8x7b", expert_parallel_size=0), "expert_parallel_size must be an integer"),
    (dict(sim_model="mixtral-8x7b", tensor_parallel_size=2, pipeline_parallel_size=2),
     "pipeline_parallel_size > 1 with a mixture of experts"),
])
def test_bad_expert_settings_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        sim_engine(**options)


def test_moe_configs_are_checked_and_run_in_the_simulator_only():
    with pytest.raises(ValueError, match="set num_experts too"):
        get_preset("llama-3-8b").with_(num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts_per_tok must be between 1 and num_experts"):
        MIXTRAL.with_(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="first_k_dense_layers"):
        MIXTRAL.with_(first_k_dense_layers=32)
    with pytest.raises(ValueError, match="mixture of experts"):
        Transformer(ModelConfig(family="llama", vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                                num_kv_heads=2, intermediate_size=8, max_position=8, num_experts=2,
                                num_experts_per_tok=1, moe_intermediate_size=4))


def test_simulate_takes_ep_and_names_the_flag_in_its_errors(capsys):
    from minibatch_engine.entrypoints.cli import main
    assert main(["simulate", "--sim-model", "mixtral-8x7b", "--ep", "8", "--expert-imbalance", "1.5",
                 "--num-requests", "4", "--max-batch", "4", "--no-progress"]) == 0
    assert main(["simulate", "--sim-model", "mixtral-8x7b", "--ep", "3", "--num-requests", "4",
                 "--no-progress"]) == 2
    assert "--ep 3 does not divide" in capsys.readouterr().err
