"""Static batching: exact tokens, real padding compute, and eta from the trace
equal to the formula of the padded layout."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch_engine import Engine, EngineConfig, SamplingParams, reference_generate
from minibatch_engine.book.efficiency import eta_padded, eta_run, eta_textbook, split_batches


def test_formulas_on_a_worked_example():
    batch = [(4, 2), (2, 6)]                     # P = 4, G = 6
    assert eta_textbook(batch) == (6 + 8) / (2 * 8)
    assert eta_padded(batch) == (5 + 7) / (2 * 9)
    assert eta_run(batch + [(3, 3)], 2) == (5 + 7 + 5) / (2 * 9 + 1 * 5)
    assert eta_padded([(7, 7)]) == 1.0
    with pytest.raises(ValueError):
        eta_padded([])


def run_sim(lengths, B, max_model_len=4096):
    engine = Engine(None, EngineConfig(scheduler="static", max_num_seqs=B, max_model_len=max_model_len,
                                       sim_gpu="H100-SXM", sim_model="llama-3-8b"))
    reqs = [engine.add_request([1] * p, SamplingParams(max_tokens=g, ignore_eos=True)) for p, g in lengths]
    engine.run()
    return engine, reqs


lengths_st = st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, B=st.integers(1, 9))
def test_trace_eta_equals_padded_layout_formula(lengths, B):
    engine, reqs = run_sim(lengths, B)
    batches = split_batches(lengths, B)
    measured = engine.trace.eta_by_batch()
    assert len(measured) == len(batches)
    for b, batch in enumerate(batches):
        assert measured[b] == pytest.approx(eta_padded(batch), rel=1e-12)
        assert eta_textbook(batch) >= measured[b] - 1e-12
    computed = sum(len(b) * (max(p for p, _ in b) + max(g for _, g in b) - 1) for b in batches)
    assert engine.trace.computed_tokens == computed
    assert engine.trace.useful_tokens == sum(p + g - 1 for p, g in lengths)
    assert engine.trace.eta() == pytest.approx(eta_run(lengths, B), rel=1e-12)
    assert all(r.num_output_tokens == g for r, (_, g) in zip(reqs, lengths))


def test_padding_is_real_compute(tiny64):
    """The forward really runs B x (P + G - 1) token rows: the step sizes in the
    trace match the tensors the model saw."""
    engine = Engine(tiny64, scheduler="static", max_num_seqs=3, max_model_len=64)
    seen = []
    orig = tiny64.forward

    def spy(input_ids, *a, **k):
        seen.append(int(input_ids.numel()))
        return orig(input_ids, *a, **k)

    tiny64.forward = spy
    try:
        for p, g in [(5, 2), (9, 6), (3, 4)]:
            engine.add_request(list(range(p)), SamplingParams(max_tokens=g, ignore_eos=True))
        engine.run()
    finally:
        del tiny64.forward
    assert seen == [s.computed_tokens for s in engine.trace.steps]
    assert seen == [27] + [3] * 5      # 3 lanes x 9 prompt positions, then 5 lockstep decodes


def test_batches_wait_for_the_longest(tiny64):
    engine = Engine(tiny64, scheduler="static", max_num_seqs=2, max_model_len=64)
    a = engine.add_request([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    b = engine.add_request([3, 4], SamplingParams(max_tokens=6, ignore_eos=True))
    c = engine.add_request([5], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.run()
    assert a.finish_step == 1 and b.finish_step == 5
    assert c.first_scheduled_step == 6          # only after the whole first batch
    pads = [sum(l.kind == "pad" for l in s.lanes) for s in engine.trace.steps]
    assert pads == [0, 0, 1, 1, 1, 1, 0]


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 12)), min_size=1, max_size=7),
       B=st.integers(1, 4))
def test_static_greedy_equals_lone_full_recompute(tiny64, lengths, B):
    torch.manual_seed(len(lengths) * 31 + B)
    engine = Engine(tiny64, scheduler="static", max_num_seqs=B, max_model_len=64)
    prompts = [torch.randint(0, 256, (p,)).tolist() for p, _ in lengths]
    reqs = [engine.add_request(pr, SamplingParams(max_tokens=g, ignore_eos=True))
            for pr, (_, g) in zip(prompts, lengths)]
    engine.run()
    for r, pr, (_, g) in zip(reqs, prompts, lengths):
        assert r.output_token_ids == reference_generate(tiny64, pr, g)


def test_batch_respects_max_model_len_of_padded_layout(tiny64):
    """max(prompt) + max(max_tokens) must fit a row, so the batch closes early."""
    engine = Engine(tiny64, scheduler="static", max_num_seqs=4, max_model_len=20)
    engine.add_request([1] * 15, SamplingParams(max_tokens=2, ignore_eos=True))
    late = engine.add_request([1] * 2, SamplingParams(max_tokens=15, ignore_eos=True))
    engine.run()
    assert late.first_scheduled_step > 0
    assert len(engine.trace.eta_by_batch()) == 2


def test_bad_requests_raise_clear_errors(tiny64):
    engine = Engine(tiny64, max_num_seqs=2, max_model_len=32)
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request([1] * 30, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="out of range"):
        engine.add_request([1, 999], SamplingParams())
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1], {"max_tokens": 3})
    engine.add_request([1], request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([2], request_id="x")
    with pytest.raises(ValueError, match="scheduler"):
        Engine(tiny64, scheduler="magic")


def test_abort_waiting_and_running(tiny64):
    engine = Engine(tiny64, max_num_seqs=1, max_model_len=64)
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    b = engine.add_request([4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.abort(b.request_id)          # waiting
    engine.step()
    engine.abort(a.request_id)          # running
    engine.run()
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort")
    assert not engine.has_unfinished() and engine.kv_cache.num_used_blocks <= 1
    assert b.first_scheduled_step is None
    with pytest.raises(KeyError):
        engine.abort("nope")


def test_nothing_dropped_and_ids_unique(tiny64):
    engine = Engine(tiny64, max_num_seqs=3, max_model_len=64)
    reqs = [engine.add_request([i + 1] * (i % 5 + 1), SamplingParams(max_tokens=i % 4 + 1, ignore_eos=True))
            for i in range(10)]
    done = engine.run()
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in reqs)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in reqs)
    assert all(s.num_scheduled <= 3 for s in engine.trace.steps)
