"""Chunked prefill: a per-step token budget, exact tokens for any chunk size,
no starvation."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch_engine import Engine, EngineConfig, SamplingParams, reference_generate

from ..conftest import SIM, sim_engine




@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 60)), min_size=1, max_size=30),
       B=st.integers(1, 8), extra=st.integers(0, 100), partial=st.integers(1, 3),
       kv=st.sampled_from(["reserved", "paged"]))
def test_budget_never_exceeded_and_everyone_finishes(lengths, B, extra, partial, kv):
    budget = B + extra
    engine = sim_engine(max_num_seqs=B, max_model_len=512, max_num_batched_tokens=budget,
                        max_num_partial_prefills=partial, kv_layout=kv)
    reqs = [engine.add_request([1] * p, SamplingParams(max_tokens=g, ignore_eos=True)) for p, g in lengths]
    engine.run()
    assert all(r.num_output_tokens == g for r, (_, g) in zip(reqs, lengths))
    assert max(s.computed_tokens for s in engine.trace.steps) <= budget
    for s in engine.trace.steps:   # prompts that span steps: at most `partial` at once
        spanning = [l for l in s.lanes if l.kind == "prefill" and (
            l.start > engine.requests[l.request_id].num_cached_tokens      # continues an earlier chunk
            or l.start + l.num_tokens < engine.requests[l.request_id].num_prompt_tokens)]
        assert len(spanning) <= partial


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10)), min_size=1, max_size=6),
       B=st.integers(1, 3), extra=st.integers(0, 12), kv=st.sampled_from(["reserved", "paged"]))
def test_any_chunk_size_gives_the_same_tokens(tiny64, lengths, B, extra, kv):
    torch.manual_seed(B * 13 + extra)
    prompts = [torch.randint(0, 256, (p,)).tolist() for p, _ in lengths]
    outs = [g for _, g in lengths]

    def run(**cfg):
        e = Engine(tiny64, EngineConfig(scheduler="continuous", max_num_seqs=B, max_model_len=64,
                                        kv_layout=kv, block_size=4, **cfg))
        rs = [e.add_request(p, SamplingParams(max_tokens=g, ignore_eos=True)) for p, g in zip(prompts, outs)]
        e.run()
        return [r.output_token_ids for r in rs], e

    chunked, e = run(max_num_batched_tokens=B + extra)
    whole, _ = run()
    assert chunked == whole == [reference_generate(tiny64, p, g) for p, g in zip(prompts, outs)]
    if B + extra < max(len(p) for p in prompts):
        assert any(l.start > 0 and l.kind == "prefill" for s in e.trace.steps for l in s.lanes)


def test_chunk_of_one_token(tiny64):
    prompt = list(b"one token at a time")
    e = Engine(tiny64, EngineConfig(scheduler="continuous", max_num_seqs=1, max_model_len=64,
                                    max_num_batched_tokens=1))
    r = e.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    e.run()
    assert [s.computed_tokens for s in e.trace.steps] == [1] * (len(prompt) + 4)
    assert r.output_token_ids == reference_generate(tiny64, prompt, 5)


def test_decodes_first_and_prefill_never_starves():
    """Seven requests decode for a long time; a long prompt arrives. With a budget
    of max_num_seqs tokens, decode tokens come first, yet the prompt gets a chunk
    in every step until it is done."""
    B = 8
    engine = sim_engine(max_num_seqs=B, max_model_len=4096, max_num_batched_tokens=B)
    decoders = [engine.add_request([1] * 4, SamplingParams(max_tokens=500, ignore_eos=True)) for _ in range(7)]
    while not all(r.output_token_ids for r in decoders):
        engine.step()
    long = engine.add_request([2] * 300, SamplingParams(max_tokens=2, ignore_eos=True))
    first = len(engine.trace)
    while long.num_output_tokens == 0:
        before = long.num_computed_tokens
        engine.step()
        step = engine.trace[-1]
        assert sum(l.kind == "decode" for l in step.lanes) == 7          # every decoder got its token
        assert long.num_computed_tokens > before                          # and the prompt progressed
    assert all(set(range(first, len(engine.trace))) <= set(r.token_steps) for r in decoders)


def test_without_chunking_a_long_prompt_stalls_everyone():
    def itl_max(chunked):
        e = sim_engine(max_num_seqs=4, max_model_len=4096, max_num_batched_tokens=4096 if not chunked else 256,
                       enable_chunked_prefill=chunked)
        ds = [e.add_request([1] * 8, SamplingParams(max_tokens=60, ignore_eos=True)) for _ in range(3)]
        for _ in range(5):
            e.step()
        e.add_request([2] * 3000, SamplingParams(max_tokens=1, ignore_eos=True))
        e.run()
        ends = [e.trace[k].sim_end for k in ds[0].token_steps]
        return max(b - a for a, b in zip(ends, ends[1:]))
    assert itl_max(chunked=False) > 3 * itl_max(chunked=True)


def test_bad_budget_settings():
    with pytest.raises(ValueError, match="starve"):
        sim_engine(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        sim_engine(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=512, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="continuous"):
        Engine(None, EngineConfig(scheduler="static", max_num_batched_tokens=64, **SIM))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)
