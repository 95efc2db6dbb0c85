import pytest
import torch

from minibatch_engine import LLM, Engine, SamplingParams
from minibatch_engine.sampling import filter_logits


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
    alone = llm.generate(["the seeded one"], params, use_tqdm=False)[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=1.0, seed=7)
    batch = llm.generate(["noise a", "the seeded one", "more noise here"], [others, params, others],
                         use_tqdm=False)
    assert batch[1].token_ids == alone
    assert batch[0].token_ids != alone
    # a different seed draws something else
    other_seed = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=99)
    assert llm.generate(["the seeded one"], other_seed, use_tqdm=False)[0].token_ids != alone


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
