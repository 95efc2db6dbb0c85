"""The simulator's step cost (issue 26): operators add up in execution order,
tensor parallelism shards weights, KV heads and projections and adds two
all-reduces per layer, the host's share is its own term, and the tokens of a
run never depend on the simulator."""
import pytest

from minibatch_engine import Engine, SamplingParams, reference_generate
from minibatch_engine.model.config import get_preset
from minibatch_engine.sim import CostModel, RooflineCostModel, get_gpu
from minibatch_engine.sim.operators import all_reduce_time

from ..conftest import sim_engine

H100, L8B, L70B = get_gpu("H100-SXM"), get_preset("llama-3-8b"), get_preset("llama-3-70b")
DECODES = [(1, 1024)] * 128


def test_kernels_run_one_after_another_so_a_chunk_next_to_decodes_is_not_free():
    """The ideal roofline lets the step's FLOPs hide its bytes: a 512-token chunk
    beside 128 decodes adds almost nothing. Priced per operator it adds several
    milliseconds, though less than the chunk alone would take."""
    cm, ideal = CostModel(H100, L8B), RooflineCostModel(H100, L8B)
    mixed = DECODES + [(512, 512)]
    extra = cm.step_time(mixed) - cm.step_time(DECODES)
    assert ideal.step_time(mixed) - ideal.step_time(DECODES) < 1e-4
    assert 3e-3 < extra < cm.step_time([(512, 512)])


def test_the_calibrated_step_is_slower_than_the_ideal_roofline():
    cm, ideal = CostModel(H100, L8B, step_overhead_s=0.0), RooflineCostModel(H100, L8B, step_overhead_s=0.0)
    for shapes in ([(1, 128)], DECODES, [(2048, 2048)]):
        assert cm.step_time(shapes) > ideal.step_time(shapes)


def test_step_parts_add_up_and_attention_grows_with_context():
    cm = CostModel(H100, L8B)
    cost = cm.step_cost(DECODES)
    assert sum(cost.parts.values()) == pytest.approx(cost.seconds)
    assert cm.step_cost([(1, 4096)] * 128).parts["attention"] > 3 * cost.parts["attention"]


def test_tensor_parallel_adds_two_all_reduces_per_layer_and_shards_the_weights():
    one, four = CostModel(H100, L70B), CostModel(H100, L70B, tensor_parallel_size=4)
    shapes = [(1, 1024)] * 64
    assert one.gpu_seconds(shapes)["all-reduce"] == 0
    per_layer = all_reduce_time(64 * L70B.hidden_size * 2, 4, H100)
    assert four.gpu_seconds(shapes)["all-reduce"] == pytest.approx(2 * L70B.num_layers * per_layer)
    assert four.weight_bytes_per_gpu == pytest.approx(one.weight_bytes / 4)
    assert four.step_time(shapes) < one.step_time(shapes)
    # 8 KV heads over 16 GPUs: each GPU keeps one, so KV memory doubles
    assert CostModel(H100, L70B, tensor_parallel_size=16).kv_replication == 2


def test_a_model_that_does_not_fit_is_refused_naming_the_memory():
    with pytest.raises(ValueError, match=r"141\.\d GB.*tensor_parallel_size 2 or more"):
        sim_engine(sim_model="llama-3-70b")
    small, big = sim_engine(sim_model="llama-3-70b", tensor_parallel_size=4, max_num_seqs=1024), \
        sim_engine(sim_model="llama-3-70b", tensor_parallel_size=8, max_num_seqs=1024)
    assert 0 < small.kv_cache.capacity_bytes < big.kv_cache.capacity_bytes


def test_tensor_parallelism_is_simulated_only(tiny64):
    with pytest.raises(ValueError, match="simulated only"):
        Engine(tiny64, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="does not divide"):
        sim_engine(tensor_parallel_size=3)


def test_cuda_graphs_and_async_scheduling_remove_host_time():
    """A small model's decode step is launch-bound: its hundreds of launches take
    longer than its kernels, and a graph replay removes them; overlapped
    scheduling hides the host's work behind the GPU's. For an 8B model the
    kernels are long enough to hide the launches already."""
    one_b = get_preset("llama-3.2-1b")
    eager = CostModel(H100, one_b, cuda_graphs=False).step_time([(1, 256)])
    graphs = CostModel(H100, one_b).step_time([(1, 256)])
    overlapped = CostModel(H100, one_b, async_scheduling=True).step_time([(1, 256)])
    assert overlapped < graphs < eager
    assert CostModel(H100, L8B, cuda_graphs=False).step_time([(1, 256)]) == CostModel(H100, L8B).step_time([(1, 256)])


def test_a_greedy_runs_tokens_do_not_depend_on_the_simulator(tiny64):
    prompts = [[1, 2, 3], list(range(10, 30)), [5] * 9]
    runs = []
    for sim in ({}, dict(sim_gpu="H100-SXM", sim_model="llama-3-8b"), dict(sim_gpu="A100-80GB")):
        engine = Engine(tiny64, max_num_seqs=2, max_model_len=64, **sim)
        reqs = [engine.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
        engine.run()
        runs.append([r.output_token_ids for r in reqs])
    assert runs[0] == runs[1] == runs[2] == [reference_generate(tiny64, p, 10) for p in prompts]
