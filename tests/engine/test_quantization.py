"""Weight quantization through torchao (issue 40): ``LLM(..., quantization=...)``
quantizes the decoder's projections, keeps the LM head and embedding, stores
fewer bytes, and every scheduling mode gives the greedy tokens of the same
quantized model recomputed alone (the correctness rule, for that model).

torchao runs in float32 or bfloat16 only, so the rule holds up to close calls,
as for any float32 model: a batch's GEMM may round differently from a lone
row's, and W8A8 can turn such a last-bit difference into a whole int8 step of
one activation. The tests accept a different token only where the lone
recompute's top two logits lie within ``CLOSE_CALL`` of each other, and compare
nothing after it (the texts differ from there). Which positions are close calls
is a property of the model and the prompt, not of the CPU."""
import pytest
import torch

from minibatch_engine import LLM, Engine, SamplingParams
from minibatch_engine.model import reference_generate
from minibatch_engine.model.reference import full_forward_logits
from minibatch_engine.model.quantization import QUANTIZATION_METHODS, quantize_weights, weight_bytes
from minibatch_engine.model.registry import resolve_model
from minibatch_engine.runner.prepack import num_packed_layers, prepack_linear_weights, unpack_linear_weights

pytest.importorskip("torchao")

PROMPTS = [list(b"def main():\n    "), list(b"import os\nimport sys\n\n"), list(b"class Point:\n"),
           list(b"    return self.")]
#: the largest top-two logit margin at which a token may differ from the lone recompute:
#: float32 rounding moves tiny-py's logits by ~1e-5; one int8 step of one activation (W8A8)
#: by up to a few hundredths (0.018 seen); tiny-py's median margin is 1 to 2
CLOSE_CALL = {"int8": 0.1, "int8_weight_only": 1e-3}


def assert_equal_up_to_a_close_call(model, prompt, got, want, tol):
    """``got`` equals the lone recompute ``want``, or first differs where the
    lone recompute's top two logits are within ``tol`` and ``got`` took the runner-up."""
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None:
        assert len(got) == len(want)
        return
    logits = full_forward_logits(model, list(prompt) + want[:first])[-1].double()
    top2 = logits.topk(2)
    margin = float(top2.values[0] - top2.values[1])
    assert margin < tol and got[first] == int(top2.indices[1]), (
        f"token {first}: got {got[first]}, the lone recompute {want[first]} by a margin of {margin:.4f}")


@pytest.fixture(scope="module", params=QUANTIZATION_METHODS)
def quantized(request):
    return request.param, resolve_model("tiny-py", device="cpu", quantization=request.param)


def test_only_the_projections_are_quantized_and_the_bytes_shrink(quantized):
    method, model = quantized
    plain = resolve_model("tiny-py", device="cpu")
    assert model.quantization == method
    assert type(model.layers[0].attn.qkv_proj.weight) is not torch.nn.Parameter
    assert type(model.lm_head.weight) is torch.nn.Parameter and type(model.embed.weight) is torch.nn.Parameter
    # int8 projections and float32 embedding / head: under a third of the float32 bytes
    assert weight_bytes(model) < weight_bytes(plain) / 3


@pytest.mark.parametrize("options", [
    dict(),                                                                   # vLLM's defaults
    dict(max_num_batched_tokens=16, max_num_seqs=4),                          # chunked prefill
    dict(num_kv_blocks=10, block_size=4, enable_prefix_caching=False),        # preemption (recompute)
    dict(scheduler="static", max_num_seqs=2),                                 # padded static batches
])
def test_every_mode_gives_the_quantized_models_lone_greedy_tokens(quantized, options):
    method, model = quantized
    n = 12
    expect = [reference_generate(model, p, n) for p in PROMPTS]
    eng = Engine(model, attention_backend="sdpa", **options)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in PROMPTS]
    eng.run()
    for p, r, want in zip(PROMPTS, reqs, expect):
        assert_equal_up_to_a_close_call(model, p, r.output_token_ids, want, CLOSE_CALL[method])


def test_the_close_call_check_can_fail():
    model = resolve_model("tiny-py", device="cpu", quantization="int8_weight_only")
    want = reference_generate(model, PROMPTS[0], 6)
    wrong = want[:3] + [(want[3] + 1) % model.config.vocab_size] + want[4:]
    with pytest.raises(AssertionError, match="token 3"):
        assert_equal_up_to_a_close_call(model, PROMPTS[0], wrong, want, CLOSE_CALL["int8_weight_only"])


def test_llm_copies_a_given_model_before_quantizing():
    plain = resolve_model("tiny-py", device="cpu")
    llm = LLM(plain, quantization="int8_weight_only", attention_backend="sdpa")
    assert llm.model is not plain and getattr(plain, "quantization", None) is None
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert_equal_up_to_a_close_call(llm.model, PROMPTS[0], out[0].outputs[0].token_ids,
                                    reference_generate(llm.model, PROMPTS[0], 8), CLOSE_CALL["int8_weight_only"])


def test_prepacking_leaves_quantized_layers_to_their_own_kernels(quantized):
    _, model = quantized
    # an Engine built earlier on this module's shared model may have packed the LM head
    # already, on CPUs where packing is faster: start from none packed
    unpack_linear_weights(model)
    switched = prepack_linear_weights(model, only_where_faster=False)
    try:
        assert switched == num_packed_layers(model) <= 1                # the LM head at most
        assert full_forward_logits(model, list(range(64))).shape == (64, model.config.vocab_size)
    finally:
        unpack_linear_weights(model)


def test_bad_settings_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="quantization='int4' is not one of 'int8', 'int8_weight_only'"):
        resolve_model("tiny", quantization="int4")
    with pytest.raises(ValueError, match="needs a float32 or bfloat16 model.*dtype='float32'"):
        resolve_model("tiny", dtype="float64", quantization="int8")
    model = resolve_model("tiny", quantization="int8")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_weights(model, "int8")
