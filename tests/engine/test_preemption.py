"""Preemption when KV memory runs out: recompute and swap lose nothing, leak
nothing, and always make progress."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch_engine import Engine, EngineConfig, SamplingParams, reference_generate
from minibatch_engine.core.request import RequestStatus

from ..conftest import SIM, assert_all_memory_back



def config(mode, blocks, swap_blocks=8, block_size=4, watermark=0.0, **kw):
    per_block = 0 if mode == "recompute" else swap_blocks
    return dict(scheduler="continuous", kv_layout="paged", block_size=block_size, num_kv_blocks=blocks,
                watermark=watermark, preemption_mode=mode, **kw), per_block


def make_engine(model, mode, blocks, swap_blocks=8, block_size=4, **kw):
    cfg, swap_blocks = config(mode, blocks, swap_blocks, block_size, **kw)
    engine = Engine(model, EngineConfig(**cfg, **({} if model is not None else SIM)))
    if mode == "swap":   # size the host pool in blocks of this engine's cache
        engine2 = Engine(model, EngineConfig(**cfg, swap_space_bytes=swap_blocks * engine.kv_cache.bytes_per_block,
                                             **({} if model is not None else SIM)))
        return engine2
    return engine


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=12),
       blocks=st.integers(20, 40), mode=st.sampled_from(["recompute", "swap"]), swap_blocks=st.integers(0, 30),
       B=st.integers(1, 8), budget=st.sampled_from([None, 8, 64]), victim=st.sampled_from(["latest", "most_blocks"]))
def test_tiny_budgets_always_progress_and_free_everything(lengths, blocks, mode, swap_blocks, B, budget, victim):
    engine = make_engine(None, mode, blocks, swap_blocks, max_num_seqs=B, max_model_len=80,
                         max_num_batched_tokens=None if budget is None else max(budget, B),
                         preemption_victim=victim)
    reqs = [engine.add_request([1] * p, SamplingParams(max_tokens=g, ignore_eos=True)) for p, g in lengths]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 20_000, "no progress"
    assert [r.num_output_tokens for r in reqs] == [g for _, g in lengths]
    assert all(r.status == RequestStatus.FINISHED for r in reqs)
    assert_all_memory_back(engine)


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20)), min_size=2, max_size=6),
       blocks=st.integers(10, 14), mode=st.sampled_from(["recompute", "swap"]), swap_blocks=st.integers(0, 12))
def test_preempted_requests_keep_their_exact_tokens(tiny64, lengths, blocks, mode, swap_blocks):
    torch.manual_seed(blocks * 7 + swap_blocks)
    prompts = [torch.randint(0, 256, (p,)).tolist() for p, _ in lengths]
    engine = make_engine(tiny64, mode, blocks, swap_blocks, max_num_seqs=4, max_model_len=64)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=g, ignore_eos=True)) for p, (_, g) in zip(prompts, lengths)]
    engine.run()
    for r, p, (_, g) in zip(reqs, prompts, lengths):
        assert r.output_token_ids == reference_generate(tiny64, p, g)
    assert_all_memory_back(engine)


def test_swap_really_moves_kv_and_falls_back_to_recompute(tiny64):
    prompts = [list(range(1 + i, 13 + i)) for i in range(4)]
    ref = [reference_generate(tiny64, p, 20) for p in prompts]
    for swap_blocks, expect_swaps in ((40, True), (0, False)):
        engine = make_engine(tiny64, "swap", 20, swap_blocks, max_num_seqs=4, max_model_len=64)
        reqs = [engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts]
        engine.run()
        assert [r.output_token_ids for r in reqs] == ref
        swaps = sum(r.num_swaps for r in reqs)
        recomputed = sum(r.num_recomputed_tokens for r in reqs)
        assert sum(r.num_preemptions for r in reqs) > 0
        assert (swaps > 0) == expect_swaps and (recomputed > 0) != expect_swaps
        if expect_swaps:
            assert engine.scheduler.preemptor.swap_space.swapped_out_bytes == engine.scheduler.preemptor.swap_space.swapped_in_bytes > 0
            assert sum(s.swap_bytes for s in engine.trace.steps) == 2 * engine.scheduler.preemptor.swap_space.swapped_out_bytes


def test_abort_frees_blocks_wherever_the_request_is(tiny64):
    engine = make_engine(tiny64, "swap", 12, 12, max_num_seqs=3, max_model_len=48)
    reqs = [engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=30, ignore_eos=True)) for _ in range(4)]
    seen = set()
    while engine.has_unfinished():
        engine.step()
        states = {r.request_id: ("swapped" if engine.scheduler.preemptor.swap_space.holds(r.request_id) else r.status.value)
                  for r in reqs if not r.is_finished}
        for rid, state in states.items():
            if state not in seen and state in ("swapped", "preempted", "waiting", "running") and len(seen) < 4:
                seen.add(state)
                engine.abort(rid)
                engine.kv_cache.manager.check_invariants()
                assert engine.kv_cache.first_block(rid) == -1 and not engine.scheduler.preemptor.swap_space.holds(rid)
                break
    assert {"running", "swapped"} <= seen
    assert_all_memory_back(engine)
    assert sum(r.finish_reason == "abort" for r in reqs) == len(seen)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_as_large_as_the_pool_still_finishes(mode):
    """Admission watermark and swap-in headroom must not lock out a request that
    needs every block once it is alone."""
    engine = make_engine(None, mode, 25, 25, max_num_seqs=4, max_model_len=100, watermark=0.2)
    big = engine.add_request([1] * 60, SamplingParams(max_tokens=40, ignore_eos=True))   # 100 tokens = 25 blocks
    small = [engine.add_request([2] * 8, SamplingParams(max_tokens=30, ignore_eos=True)) for _ in range(3)]
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        engine.step()
    assert big.num_output_tokens == 40 and all(r.num_output_tokens == 30 for r in small)
    assert_all_memory_back(engine)


def test_swap_time_is_charged_on_the_sim_clock():
    from minibatch_engine.model import get_preset
    from minibatch_engine.sim import RooflineCostModel, get_gpu
    cost = RooflineCostModel(get_gpu("H100-SXM"), get_preset("llama-3-8b"))
    shapes = [(1, 100)] * 4
    assert cost.step_time(shapes, swap_bytes=64e9) == pytest.approx(cost.step_time(shapes) + 1.0)


def test_bad_preemption_settings():
    with pytest.raises(ValueError, match="paged"):
        EngineConfig(scheduler="continuous", kv_layout="reserved", preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(scheduler="continuous", kv_layout="paged", preemption_mode="drop")
    with pytest.raises(ValueError, match="victim"):
        Engine(None, EngineConfig(scheduler="continuous", kv_layout="paged", preemption_victim="random", **SIM))


@pytest.mark.cuda
def test_cuda_paged_chunked_swap_matches_cpu_reference(tiny64):
    """The whole stack on a GPU (float64): paged cache, chunked prefill, swap
    preemption through pinned host memory; tokens equal the CPU reference."""
    from minibatch_engine.model import build_model
    gpu = build_model("tiny", device="cuda", dtype="float64")
    prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(5)]
    engine = make_engine(gpu, "swap", 24, 24, max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=25, ignore_eos=True)) for p in prompts]
    engine.run()
    assert engine.runner.host_pool.host.is_pinned()
    assert sum(r.num_preemptions for r in reqs) > 0
    assert [r.output_token_ids for r in reqs] == [reference_generate(tiny64, p, 25) for p in prompts]
    assert_all_memory_back(engine)
