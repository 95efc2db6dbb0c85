"""Iteration-level scheduling: exact tokens, nothing lost, places refilled at once."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch_engine import Engine, EngineConfig, SamplingParams, reference_generate

from ..conftest import SIM



def check_refill_invariants(engine, reqs, max_num_seqs):
    """On the trace: the batch never exceeds max_num_seqs, and whenever a place is
    free at a step no request that had arrived is left waiting."""
    for s in engine.trace.steps:
        running = [r for r in reqs if r.first_scheduled_step is not None
                   and r.first_scheduled_step <= s.step <= r.finish_step]
        assert s.num_scheduled == len(running) <= max_num_seqs
        waiting = [r for r in reqs if r.arrival_step <= s.step
                   and (r.first_scheduled_step is None or r.first_scheduled_step > s.step)]
        if len(running) < max_num_seqs:
            assert not waiting, f"step {s.step}: free place but {len(waiting)} waiting"


lengths_st = st.lists(st.tuples(st.integers(1, 200), st.integers(1, 200)), min_size=1, max_size=50)


@settings(max_examples=50, deadline=None)
@given(lengths=lengths_st, B=st.integers(1, 8))
def test_nothing_lost_no_padding_and_immediate_refill(lengths, B):
    engine = Engine(None, EngineConfig(scheduler="continuous", max_num_seqs=B, max_model_len=512, **SIM))
    reqs = [engine.add_request([1] * p, SamplingParams(max_tokens=g, ignore_eos=True)) for p, g in lengths]
    done = engine.run()
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs)   # none lost or twice
    assert [r.num_output_tokens for r in reqs] == [g for _, g in lengths]
    assert engine.trace.eta() == 1.0                                                 # no padding at all
    check_refill_invariants(engine, reqs, B)
    assert engine.kv_cache.num_used_blocks == 0


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 60)), min_size=1, max_size=30),
       B=st.integers(1, 6), rate=st.floats(0.5, 50))
def test_poisson_arrivals_refill_invariants(lengths, B, rate):
    engine = Engine(None, EngineConfig(scheduler="continuous", max_num_seqs=B, max_model_len=256, **SIM))
    t, reqs = 0.0, []
    for i, (p, g) in enumerate(lengths):
        t += (i % 3) / rate
        reqs.append(engine.add_request([1] * p, SamplingParams(max_tokens=g, ignore_eos=True), arrival_time=t))
    engine.run()
    assert all(r.is_finished and r.num_output_tokens == g for r, (_, g) in zip(reqs, lengths))
    check_refill_invariants(engine, reqs, B)


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 14)), min_size=2, max_size=8),
       B=st.integers(1, 4))
def test_continuous_greedy_equals_lone_full_recompute(tiny64, lengths, B):
    """Requests enter and leave at different steps; each one's tokens equal its
    lone full recompute."""
    torch.manual_seed(B * 100 + len(lengths))
    engine = Engine(tiny64, scheduler="continuous", max_num_seqs=B, max_model_len=64)
    prompts = [torch.randint(0, 256, (p,)).tolist() for p, _ in lengths]
    reqs = [engine.add_request(pr, SamplingParams(max_tokens=g, ignore_eos=True))
            for pr, (_, g) in zip(prompts, lengths)]
    engine.run()
    starts = {r.first_scheduled_step for r in reqs}
    for r, pr, (_, g) in zip(reqs, prompts, lengths):
        assert r.output_token_ids == reference_generate(tiny64, pr, g)
    if len(lengths) > B:
        assert len(starts) > 1                   # some requests really joined mid-run


def test_mixed_prefill_and_decode_in_one_step(tiny64):
    engine = Engine(tiny64, scheduler="continuous", kv_layout="reserved", max_num_batched_tokens=None,
                    max_num_seqs=2, max_model_len=64)
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    b = engine.add_request([4, 5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    c = engine.add_request([8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.run()
    # a finishes in step 1; c takes its row in step 2 with its prompt, next to b's decode token
    assert a.finish_step == 1 and c.first_scheduled_step == 2
    kinds = sorted((l.request_id, l.kind, l.num_tokens) for l in engine.trace[2].lanes)
    assert kinds == [(b.request_id, "decode", 1), (c.request_id, "prefill", 2)]
    assert engine.trace[2].lanes[1].first_block == engine.trace[0].lanes[0].first_block   # the row a freed
    for r in (a, b, c):
        assert r.output_token_ids == reference_generate(tiny64, r.prompt_token_ids, r.sampling_params.max_tokens)


def test_same_tokens_as_static(tiny64):
    def run(name):
        e = Engine(tiny64, scheduler=name, max_num_seqs=3, max_model_len=64)
        rs = [e.add_request(list(range(i, i + 3 + i % 4)), SamplingParams(max_tokens=2 + i % 5, ignore_eos=True))
              for i in range(7)]
        e.run()
        return [r.output_token_ids for r in rs], len(e.trace)
    (static_out, static_steps), (cont_out, cont_steps) = run("static"), run("continuous")
    assert static_out == cont_out and cont_steps < static_steps


def test_abort_frees_the_row_for_the_next_step(tiny64):
    engine = Engine(tiny64, scheduler="continuous", max_num_seqs=1, max_model_len=64)
    a = engine.add_request([1, 2], SamplingParams(max_tokens=20, ignore_eos=True))
    b = engine.add_request([3], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    engine.abort(a.request_id)
    assert engine.kv_cache.num_used_blocks == 0
    engine.step()
    assert b.first_scheduled_step == 1
    engine.run()
    assert a.finish_reason == "abort" and b.finish_reason == "length"


def test_latency_metrics_in_steps_and_seconds(tiny64):
    from minibatch_engine.harness.metrics import request_metrics
    engine = Engine(tiny64, EngineConfig(scheduler="continuous", max_num_seqs=1, max_model_len=64, **SIM))
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    b = engine.add_request([4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.run()
    ma, mb = request_metrics(a, engine.trace), request_metrics(b, engine.trace)
    assert (ma.ttft_steps, ma.e2e_steps, ma.queue_steps, ma.itl_steps) == (1, 3, 0, [1, 1])
    assert (mb.queue_steps, mb.ttft_steps, mb.e2e_steps) == (3, 4, 5)
    sim = mb.seconds["sim"]
    assert sim["ttft"] == pytest.approx(engine.trace[3].sim_end)
    assert sim["queue"] == pytest.approx(engine.trace[3].sim_start)
    assert sim["e2e"] >= sim["ttft"] > sim["queue"] > 0
    assert ma.seconds["wall"]["ttft"] > 0
