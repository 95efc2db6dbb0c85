"""Log-probabilities (``SamplingParams.logprobs`` and ``prompt_logprobs``) equal
a lone float64 full recompute's log-softmax, whatever the scheduler, chunking,
prefix cache or preemption."""
import pytest
import torch

from minibatch_engine import LLM, Engine, SamplingParams
from minibatch_engine.sampling.logprobs import as_dicts
from minibatch_engine.model.reference import full_forward_logits
from minibatch_engine import SpeculativeConfig

from ..conftest import assert_all_memory_back

PROMPTS = [list(range(5, 28)), [7, 3, 9, 200, 11, 4, 4, 4, 90, 31, 17], [42, 43]]


def reference_logprobs(model, tokens):
    """Row p: log-probabilities of the token after position p, by full recompute."""
    return torch.log_softmax(full_forward_logits(model, tokens).double(), dim=-1)


def check(model, prompt, out, n_top, prompt_n, tol=1e-9):
    """The output's and the prompt's log-probabilities against the reference."""
    ids = out.outputs[0].token_ids
    lp = reference_logprobs(model, prompt + ids)
    for i, (tok, d) in enumerate(zip(ids, out.outputs[0].logprobs)):
        row = lp[len(prompt) - 1 + i]
        assert d[tok].logprob == pytest.approx(row[tok].item(), abs=tol)
        assert d[tok].rank == int((row > row[tok]).sum()) + 1
        top = row.topk(n_top)
        assert set(d) == set(top.indices.tolist()) | {tok}
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert d[t].logprob == pytest.approx(v, abs=tol)
        assert len(d) == n_top + (tok not in top.indices.tolist())
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)), abs=max(1e-7, 10 * tol))
    if prompt_n is None:
        assert out.prompt_logprobs is None
        return
    pl = out.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None
    for p in range(1, len(prompt)):
        row, tok = lp[p - 1], prompt[p]
        assert pl[p][tok].logprob == pytest.approx(row[tok].item(), abs=tol)
        top = row.topk(prompt_n)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert pl[p][t].logprob == pytest.approx(v, abs=tol)


CONFIGS = {
    "continuous": {},
    "chunked-5": dict(max_num_batched_tokens=5, max_num_seqs=3),        # prompts split over chunks
    "chunk-1": dict(max_num_batched_tokens=3, max_num_seqs=3),
    "no-chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64),
    "static": dict(scheduler="static", kv_layout="reserved", max_model_len=64),
    "reserved": dict(kv_layout="reserved", max_model_len=64),
    "preempting": dict(num_kv_blocks=11, block_size=4, max_num_seqs=3, max_num_batched_tokens=8),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logprobs_equal_a_lone_recompute(tiny64, name):
    llm = LLM(tiny64, **CONFIGS[name])
    params = [SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=5, logprobs=0),
              SamplingParams(max_tokens=4, logprobs=5, prompt_logprobs=0, temperature=0.8, seed=3)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, p, out in zip(PROMPTS, params, outs):
        check(tiny64, prompt, out, p.logprobs, p.prompt_logprobs)
    if name == "preempting":                    # the case is what it says: recomputed prompts
        assert sum(len(t.preempted) for t in llm.engine.trace) > 0
    assert_all_memory_back(llm.engine)


def test_logprobs_zero_is_the_sampled_token_alone(tiny64):
    out = LLM(tiny64).generate([PROMPTS[0]], SamplingParams(max_tokens=3, logprobs=0), use_tqdm=False)[0]
    assert [list(d) for d in out.outputs[0].logprobs] == [[t] for t in out.outputs[0].token_ids]
    none = LLM(tiny64).generate([PROMPTS[0]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert none.outputs[0].logprobs is None and none.prompt_logprobs is None
    assert none.outputs[0].token_ids == out.outputs[0].token_ids       # asking changes no token


def test_prompt_logprobs_skip_the_prefix_cache(tiny64):
    """A cached prompt has no logits: a request asking for prompt logprobs
    computes its whole prompt (no cache hit) and gets every position; the same
    prompt without them hits the cache."""
    prompt = list(range(10, 30))
    engine = Engine(tiny64, block_size=4)
    first = engine.add_request(prompt, SamplingParams(max_tokens=2))
    engine.run()
    hit = engine.add_request(prompt, SamplingParams(max_tokens=2))
    asks = engine.add_request(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))
    engine.run()
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens == 16 and asks.num_cached_tokens == 0
    lp = reference_logprobs(tiny64, prompt)
    pl = as_dicts(asks.prompt_logprobs)
    assert len(pl) == len(prompt) and pl[0] is None
    assert [pl[p][prompt[p]].logprob for p in range(1, len(prompt))] == pytest.approx(
        [lp[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=1e-9)
    assert_all_memory_back(engine)


def test_logprobs_under_speculative_decoding(tiny64):
    """Requests that ask for logprobs are not speculated; the others still are."""
    spec = SpeculativeConfig("ngram", 3)
    llm = LLM(tiny64, speculative=spec)
    rep = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    params = [SamplingParams(max_tokens=8, logprobs=2), SamplingParams(max_tokens=8)]
    outs = llm.generate([rep, rep], params, use_tqdm=False)
    check(tiny64, rep, outs[0], 2, None)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert_all_memory_back(llm.engine)


def test_n_samples_each_get_their_logprobs(tiny64):
    out = LLM(tiny64).generate([PROMPTS[1]], SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=5,
                                                            logprobs=1), use_tqdm=False)[0]
    for o in out.outputs:
        lp = reference_logprobs(tiny64, PROMPTS[1] + o.token_ids)
        for i, (t, d) in enumerate(zip(o.token_ids, o.logprobs)):
            assert d[t].logprob == pytest.approx(lp[len(PROMPTS[1]) - 1 + i, t].item(), abs=1e-9)


@pytest.mark.parametrize("kwargs, field", [
    ({"logprobs": -1}, "logprobs"), ({"logprobs": 1.5}, "logprobs"), ({"prompt_logprobs": -2}, "prompt_logprobs"),
])
def test_bad_logprobs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_float32_logprobs_are_close_to_float64(tiny32, tiny64):
    out = LLM(tiny32).generate([PROMPTS[0]], SamplingParams(max_tokens=4, logprobs=2, prompt_logprobs=2),
                               use_tqdm=False)[0]
    check(tiny64, PROMPTS[0], out, 2, 2, tol=1e-4)


def test_the_simulator_refuses_logprobs():
    from minibatch_engine import EngineConfig
    engine = Engine(None, EngineConfig(sim_gpu="H100-SXM", sim_model="llama-3-8b"))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request([1, 2, 3], SamplingParams(logprobs=1))
