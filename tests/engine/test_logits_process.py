"""vLLM's sampling parameters (penalties, min_p, min_tokens, logit_bias,
bad_words, include_stop_str_in_output, truncate_prompt_tokens): the batched
processors against a plain per-row reference written here, and through the
engine against a greedy full recompute that applies the reference."""
import math
import re

import pytest
import torch

from minibatch_engine import LLM, Engine, SamplingParams
from minibatch_engine.sampling.logits_process import apply_logits_processors, bad_words_token_ids
from minibatch_engine.model.reference import full_forward_logits

from ..conftest import assert_all_memory_back

EOS = 2


def reference_row(row, p, prompt, output, eos=EOS):
    """One row, one rule at a time, in vLLM's order, with Python loops."""
    x = row.clone().double()
    for w in p.bad_words_token_ids:
        if len(w) == 1 or list(output[len(output) - len(w) + 1:]) == list(w[:-1]):
            x[w[-1]] = -math.inf
    if len(output) < p.min_tokens:
        for t in list(p.stop_token_ids) + ([] if p.ignore_eos else [eos]):
            x[t] = -math.inf
    for t, b in p.logit_bias or ():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    if p.min_p > 0 and not p.greedy:
        probs = torch.softmax(x / p.temperature, dim=-1)
        x[probs < p.min_p * probs.max()] = -math.inf
    return x


def random_params(g, vocab):
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    return SamplingParams(
        max_tokens=20, temperature=pick(0.0, 0.7, 1.3),
        repetition_penalty=pick(1.0, 1.2, 0.8), frequency_penalty=pick(0.0, 0.5, -0.3),
        presence_penalty=pick(0.0, 1.0, -1.5), min_p=pick(0.0, 0.05, 0.3), min_tokens=pick(0, 3, 8),
        logit_bias=pick(None, {1: 5.0, 7: -100.0}, {3: 2.5}),
        bad_words_token_ids=pick((), ((5,),), ((4, 6), (9,))), stop_token_ids=pick((), (11, 12)))


def test_batched_processors_equal_the_per_row_reference():
    g = torch.Generator().manual_seed(0)
    vocab, S = 40, 24
    params = [random_params(g, vocab) for _ in range(S)]
    histories = []
    for _ in range(S):
        n_prompt, n_out = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(0, 10, (1,), generator=g))
        histories.append(torch.randint(vocab, (n_prompt + n_out,), generator=g).tolist())
        histories[-1].append(n_prompt)                   # (split off below)
    n_prompt = [h.pop() for h in histories]
    for h, n in zip(histories[:3], n_prompt):            # some rows end with a bad word's prefix
        h[-1] = 4
    logits = torch.randn(S, vocab, generator=g, dtype=torch.float64) * 3
    got = apply_logits_processors(logits, params, histories, n_prompt, EOS)
    for i, p in enumerate(params):
        want = reference_row(logits[i], p, histories[i][:n_prompt[i]], histories[i][n_prompt[i]:])
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        fin = torch.isfinite(want)
        assert torch.allclose(got[i][fin], want[fin], atol=1e-12), i
    assert torch.equal(logits, logits.clone())                            # the input is left alone


def greedy_reference(model, prompt, p, max_tokens, eos=EOS):
    """Greedy decoding by full recompute, each step's logits through the reference."""
    out = []
    for _ in range(max_tokens):
        row = full_forward_logits(model, prompt + out)[-1]
        t = int(torch.argmax(reference_row(row, p, prompt, out, eos)))
        out.append(t)
        if t in p.stop_token_ids or (t == eos and not p.ignore_eos):
            break
    return out


PENALISED = [
    SamplingParams(max_tokens=12, repetition_penalty=1.5),
    SamplingParams(max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_tokens=12, logit_bias={65: 8.0, 66: 4.0}),
    SamplingParams(max_tokens=12, bad_words_token_ids=((65,), (66, 67))),
    SamplingParams(max_tokens=12, min_tokens=6, stop_token_ids=(65,), logit_bias={65: 20.0}),
    SamplingParams(max_tokens=12),
]


@pytest.mark.parametrize("config", [{}, dict(max_num_batched_tokens=4, max_num_seqs=4),
                                    dict(scheduler="static", kv_layout="reserved", max_model_len=64)])
def test_greedy_with_processors_equals_a_reference_recompute(tiny64, config):
    prompts = [[10 + i, 65, 66, 67, 65, 66] + [i] * (i + 1) for i in range(len(PENALISED))]
    llm = LLM(tiny64, **config)
    outs = llm.generate(prompts, PENALISED, use_tqdm=False)
    eos = llm.engine.eos_token_id
    for prompt, p, out in zip(prompts, PENALISED, outs):
        assert out.outputs[0].token_ids == greedy_reference(tiny64, prompt, p, p.max_tokens, eos)
    # min_tokens holds the (heavily biased) stop token back for six tokens, then lets it end the output
    assert outs[4].outputs[0].token_ids[6:] == [65] and outs[4].outputs[0].finish_reason == "stop"
    assert_all_memory_back(llm.engine)


def test_processors_do_not_touch_other_rows_or_defaults(tiny64):
    """A penalised request batched with plain ones leaves their tokens alone."""
    prompts = [[5, 6, 7, 8], [9, 9, 9]]
    plain = LLM(tiny64).generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    mixed = LLM(tiny64).generate(prompts, [SamplingParams(max_tokens=8),
                                           SamplingParams(max_tokens=8, repetition_penalty=2.0)], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_min_p_and_seeded_sampling_follow_the_reference(tiny64):
    """Sampled rows: the engine's min_p keeps exactly the tokens the reference keeps
    (checked at every step of a seeded run through the processed logits)."""
    p = SamplingParams(max_tokens=10, temperature=0.9, min_p=0.2, seed=4, repetition_penalty=1.3)
    prompt = [20, 21, 22, 23]
    out = LLM(tiny64).generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids
    for i, t in enumerate(out):
        row = full_forward_logits(tiny64, prompt + out[:i])[-1]
        want = reference_row(row, p, prompt, out[:i], EOS)
        assert torch.isfinite(want[t])                    # every drawn token survives min_p
        got = apply_logits_processors(row[None], [p], [prompt + out[:i]], [len(prompt)], EOS)[0]
        assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_bad_words_through_the_tokenizer():
    llm = LLM("tiny")
    base = llm.generate(["abc abc abc"], SamplingParams(max_tokens=24), use_tqdm=False)[0].outputs[0].text
    word = re.findall(r"[A-Za-z]{2,}", base)[0]          # a word the model does write
    out = llm.generate(["abc abc abc"], SamplingParams(max_tokens=24, bad_words=[word]),
                       use_tqdm=False)[0].outputs[0].text
    assert word not in out
    ids = bad_words_token_ids([" hi"], llm.tokenizer.encode)
    assert ids == (tuple(b"hi"),)           # " hi" is one more byte, not another spelling: vLLM's rule


def test_include_stop_str_in_output():
    llm = LLM("tiny")
    text = llm.generate(["hello"], SamplingParams(max_tokens=30), use_tqdm=False)[0].outputs[0].text
    stop = text[5:7]
    cut = llm.generate(["hello"], SamplingParams(max_tokens=30, stop=[stop]), use_tqdm=False)[0].outputs[0]
    kept = llm.generate(["hello"], SamplingParams(max_tokens=30, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    i = text.find(stop)
    assert cut.text == text[:i] and kept.text == text[:i + len(stop)]
    assert cut.token_ids == kept.token_ids and cut.finish_reason == kept.finish_reason == "stop"


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny64):
    prompt = list(range(30, 60))
    llm = LLM(tiny64)
    cut = llm.generate([prompt], SamplingParams(max_tokens=5, truncate_prompt_tokens=7), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-7:]
    assert cut.outputs[0].token_ids == llm.generate([prompt[-7:]], SamplingParams(max_tokens=5),
                                                    use_tqdm=False)[0].outputs[0].token_ids
    fit = LLM(tiny64, max_model_len=20).generate(
        [prompt], SamplingParams(max_tokens=5, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert fit.prompt_token_ids == prompt[-15:]


@pytest.mark.parametrize("kwargs, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logit_bias": {3: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"bad_words": [""]}, "bad_words"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_checks_what_needs_the_model(tiny64):
    llm = LLM(tiny64)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words"):             # the engine has no tokenizer
        Engine(tiny64).add_request([1, 2], SamplingParams(bad_words=["x"]))


def test_min_tokens_holds_stop_strings_back():
    """vLLM checks stop strings from the min_tokens-th token on: one that ends
    earlier does not stop the output (offline and streamed alike)."""
    import asyncio
    from minibatch_engine import AsyncLLM
    llm = LLM("tiny")
    text = llm.generate(["hello"], SamplingParams(max_tokens=30), use_tqdm=False)[0].outputs[0].text
    stop = text[1:3]
    ids = llm.generate(["hello"], SamplingParams(max_tokens=30), use_tqdm=False)[0].outputs[0].token_ids
    m = 8                                                   # past the stop string's first occurrence
    assert len(llm.tokenizer.decode(ids[:m - 1])) > text.find(stop) + len(stop)
    held = llm.generate(["hello"], SamplingParams(max_tokens=30, stop=[stop], min_tokens=m), use_tqdm=False)
    later = text.find(stop, len(llm.tokenizer.decode(ids[:m - 1])) - len(stop) + 1)
    want = text if later < 0 else text[:later]
    assert held[0].outputs[0].text == want

    async def streamed():
        a = AsyncLLM("tiny")
        try:
            return "".join([o.text async for o in a.stream("hello", SamplingParams(
                max_tokens=30, stop=[stop], min_tokens=m))])
        finally:
            await a.shutdown()
    assert asyncio.run(streamed()) == want
