import pytest
import torch

from minibatch_engine import LLM, Engine, SamplingParams
from minibatch_engine.sampling.sampler import PREFIX, filter_logits, sample, sampling_probs


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"seed": -3}, "seed"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [False, False, True, True]
    # probabilities about .64 .24 .09 .03; cumulative before each: 0 .64 .88 .97
    kept = lambda top_p: (~torch.isinf(filter_logits(logits, 0, top_p))).tolist()  # noqa: E731
    assert kept(0.7) == [True, True, False, False]     # the token that crosses p stays
    assert kept(0.5) == [True, False, False, False]    # the first token alone crosses it
    assert kept(0.9) == [True, True, True, False]
    assert kept(1.0) == [True] * 4


def test_seeded_sampling_is_the_same_alone_or_batched(tiny64):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    llm = LLM(tiny64, max_num_seqs=4)
    alone = llm.generate(["the seeded one"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.0, seed=7)
    batch = llm.generate(["noise a", "the seeded one", "more noise here"], [others, params, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert batch[0].outputs[0].token_ids != alone
    # a different seed draws something else
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=99)
    assert llm.generate(["the seeded one"], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_tokens_and_eos(tiny64):
    engine = Engine(tiny64, max_num_seqs=2, max_model_len=64)
    first = engine.add_request(list(b"stop here"), SamplingParams(max_tokens=10))
    engine.run()
    tok = first.output_token_ids[2]
    stop = Engine(tiny64, max_num_seqs=2, max_model_len=64)
    r = stop.add_request(list(b"stop here"), SamplingParams(max_tokens=10, stop_token_ids=[tok]))
    stop.run()
    assert r.finish_reason == "stop" and r.output_token_ids == first.output_token_ids[:first.output_token_ids.index(tok) + 1]
    eos = Engine(tiny64, max_num_seqs=2, max_model_len=64, eos_token_id=tok)
    a = eos.add_request(list(b"stop here"), SamplingParams(max_tokens=10))
    b = eos.add_request(list(b"stop here"), SamplingParams(max_tokens=10, ignore_eos=True))
    eos.run()
    assert a.finish_reason == "stop" and b.finish_reason == "length" and len(b.output_token_ids) == 10


def _row_reference(logits, p):
    """One row the slow way: divide, mask by the tie rule read literally, softmax."""
    x = logits.double() / p.temperature
    if p.top_k and p.top_k < x.numel():
        x = x.masked_fill(x < torch.sort(x, descending=True).values[p.top_k - 1], float("-inf"))
    if p.top_p < 1.0:           # out: the tokens whose strictly more likely ones hold top_p or more
        probs = torch.softmax(x, -1)
        before = ((probs[None, :] > probs[:, None]) * probs[None, :]).sum(1)
        x = x.masked_fill(before >= p.top_p, float("-inf"))
    return torch.softmax(x, -1)


def test_the_batched_distributions_equal_each_row_alone():
    """Mixed parameters in one batch, including flat rows whose nucleus lies past
    the first prefix of 64 tokens (the prefix widens) and a top-p that keeps
    the most likely token only."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen) * torch.tensor([[3.0], [0.05], [1.0], [0.01], [2.0], [1.0]])
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.3, top_k=20), SamplingParams(temperature=0.9, top_p=0.999),
              SamplingParams(temperature=1.0, top_k=300, top_p=0.8), SamplingParams(temperature=1.0, top_p=1e-9)]
    got = sampling_probs(logits, params)
    for row, p in enumerate(params):
        want = _row_reference(logits[row], p)
        assert torch.equal(got[row] > 0, want > 0), f"row {row}: different tokens kept"
        torch.testing.assert_close(got[row].double(), want, rtol=1e-5, atol=1e-7)
    assert (got[5] > 0).sum() == 1 and (got[3] > 0).sum() > 300    # past the 300-token prefix
    # top-p alone: a peaked row's nucleus lies in the first PREFIX tokens, a flat row's does not
    only_p = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.95)]
    rows = torch.stack([logits[0] * 4, logits[1]])
    got = sampling_probs(rows, only_p)
    for row, p in enumerate(only_p):
        want = _row_reference(rows[row], p)
        assert torch.equal(got[row] > 0, want > 0), f"row {row}: different tokens kept"
        torch.testing.assert_close(got[row].double(), want, rtol=1e-5, atol=1e-7)
    assert (got[0] > 0).sum() < PREFIX < (got[1] > 0).sum()


def test_draws_follow_the_distribution_and_seeds_ignore_the_batch():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]]))
    hot = SamplingParams(temperature=1.0)
    draws = sample(logits.repeat(20000, 1), [hot] * 20000, [None] * 20000)
    freq = torch.bincount(draws, minlength=5).double() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], dtype=torch.double), atol=0.015, rtol=0)
    assert freq[4] == 0                                   # a token of probability 0 is never drawn
    seeded = SamplingParams(temperature=1.0, seed=11)
    mixed = torch.randn(5, 5)
    mixed[2] = logits[0]
    alone = [sample(logits, [seeded], [torch.Generator().manual_seed(11)]).item() for _ in range(2)]
    batch = sample(mixed, [SamplingParams(), hot, seeded, hot, SamplingParams(temperature=0.5, seed=3)],
                   [None, None, torch.Generator().manual_seed(11), None, torch.Generator().manual_seed(3)])
    assert batch[2].item() == alone[0] == alone[1]
    assert batch[0].item() == int(torch.argmax(mixed[0]))    # greedy rows: argmax


def test_a_row_of_nan_logits_fails_alone():
    logits = torch.randn(3, 8)
    logits[1] = float("nan")
    params = [SamplingParams(temperature=1.0)] * 3
    errors = {}
    tokens = sample(logits, params, [None] * 3, errors)
    assert list(errors) == [1] and "not finite" in errors[1] and tokens.shape == (3,)
    with pytest.raises(RuntimeError, match="not finite"):
        sample(logits, params, [None] * 3)
    with pytest.raises(ValueError, match="3 rows of logits for 2"):
        sampling_probs(logits, params[:2])
