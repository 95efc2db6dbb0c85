"""Structured output inside the batch: grammars (xgrammar) as per-row token masks.

Outputs follow their grammar (JSON schemas validate, regexes fullmatch,
choices are choices) at temperature 1 over many seeds; the batched mask equals
a plain per-token reference; a greedy constrained request equals a masked lone
recompute; rows without a grammar get exactly the tokens they get alone; and
the interactions (speculation, preemption, chunked prefill, prefix caching,
parallel sampling, log-probabilities) keep all of that."""
import json
import math
import pickle
import re

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar", reason="structured output needs xgrammar: pip install "
                                              "'minibatch-engine[structured]'")

from minibatch_engine import LLM, Engine, SamplingParams, SpeculativeConfig, reference_generate  # noqa: E402
from minibatch_engine.model import ByteTokenizer  # noqa: E402
from minibatch_engine.model.reference import full_forward_logits  # noqa: E402
from minibatch_engine.model.tokenizer import HFTokenizer  # noqa: E402
from minibatch_engine.model.trained import trained_model_path  # noqa: E402
from minibatch_engine.core.outputs import SchedulerOutput  # noqa: E402
from minibatch_engine.sampling.structured_output import (StructuredOutputManager, StructuredOutputsParams,  # noqa: E402
                                                apply_bitmask, unpack_bitmask)

from ..conftest import assert_all_memory_back  # noqa: E402
from .test_architecture import _tensors_reachable  # noqa: E402

TOK = ByteTokenizer()
BACKEND = "sdpa"            # (any backend would do: masks touch only the logits)
EOS = TOK.eos_token_id
SEEDS = range(24)

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "label": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                  "required": ["color"], "additionalProperties": False}},
        "required": ["point", "label"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c d", "é"]}, "minItems": 1, "maxItems": 4},
        "grid": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                 "maxItems": 3},
        "mode": {"enum": ["fast", "slow", None, 3]}},
        "required": ["tags", "grid", "mode"], "additionalProperties": False},
}


def validate(value, schema) -> None:
    """``jsonschema`` when installed, else an explicit check of the keywords the
    schemas above use."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(value, schema)
        return
    if "enum" in schema:
        assert value in schema["enum"], value
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(schema["properties"])
        for k, v in value.items():
            validate(v, schema["properties"][k])
    elif kind == "array":
        assert isinstance(value, list)
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf)
        for v in value:
            validate(v, schema["items"])
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", -math.inf) <= value <= schema.get("maximum", math.inf)
    elif kind == "boolean":
        assert isinstance(value, bool)
    elif kind == "string":
        assert isinstance(value, str) and re.fullmatch(schema["pattern"].strip("^$"), value)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", dtype="float32", max_num_seqs=32, attention_backend=BACKEND)


def sampled(llm, grammar, n=len(SEEDS), max_tokens=160, prompt="Answer: "):
    """One output per seed at temperature 1, all in one batch."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, structured_outputs=grammar)
              for s in range(n)]
    return [o.outputs[0] for o in llm.generate([prompt] * n, params, use_tqdm=False)]


# --- what the output looks like ---------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_always_parses_and_validates(llm, name):
    outs = sampled(llm, {"json": SCHEMAS[name]})
    for o in outs:
        assert o.finish_reason == "stop" and o.token_ids[-1] == EOS
        validate(json.loads(o.text), SCHEMAS[name])          # json.loads is strict: no raw control characters
    assert len({o.text for o in outs}) > 3                   # temperature 1: the seeds draw different objects


def test_json_object_output_is_an_object(llm):
    outs = sampled(llm, {"json_object": True}, max_tokens=200)
    done = [o for o in outs if o.finish_reason == "stop"]
    assert len(done) >= len(outs) // 2
    for o in done:
        assert isinstance(json.loads(o.text), dict)
    for o in outs:                  # the others were cut by max_tokens, on the way to an object
        assert o.text.startswith("{")


def test_regex_output_fullmatches(llm):
    pattern = r"[a-z]{2,5}-\d{1,3}(\.[0-9]{1,2})?"
    outs = sampled(llm, {"regex": pattern})
    assert all(o.finish_reason == "stop" and re.fullmatch(pattern, o.text) for o in outs), [o.text for o in outs]


def test_choice_output_is_one_of_the_choices(llm):
    choices = ["yes", "no", 'a "quoted" \\ one', "naïve\nline"]
    outs = sampled(llm, {"choice": choices})
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs)


def test_ebnf_grammar_output_is_a_sentence(llm):
    grammar = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = sampled(llm, {"grammar": grammar})
    assert all(o.finish_reason == "stop" and re.fullmatch(r"\((\d{1,2})(,\d{1,2})*\)", o.text) for o in outs)


def test_the_grammar_ends_the_request_even_with_ignore_eos(llm):
    out = llm.generate(["x"], SamplingParams(max_tokens=50, ignore_eos=True, structured_outputs={"choice": ["ok"]}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == list(b"ok") + [EOS] and out.finish_reason == "stop"


# --- the mask ------------------------------------------------------------------------------
def test_the_batched_mask_equals_a_plain_reference():
    g = torch.Generator().manual_seed(0)
    S, vocab, R = 6, 70, 3                          # 70: the last word is partly past the vocabulary
    logits = torch.randn(S, vocab, generator=g, dtype=torch.float64)
    bitmask = torch.randint(-2**31, 2**31, (R, 3), generator=g, dtype=torch.int64).to(torch.int32).numpy()
    rows, masks = [4, 0, 2], [1, 2, 1]              # rows 1, 3, 5 have no grammar
    before = logits.clone()
    got = apply_bitmask(logits, bitmask, rows, masks)
    want = logits.clone()
    for r, m in zip(rows, masks):
        for t in range(vocab):
            if not (int(bitmask[m, t // 32]) >> (t % 32)) & 1:
                want[r, t] = -math.inf
    assert torch.equal(got, want) and torch.equal(logits, before)    # a new tensor; the input untouched
    assert (got[rows] == -math.inf).any() and torch.equal(got[[1, 3, 5]], before[[1, 3, 5]])
    theirs = logits[rows].float().clone()           # xgrammar's own kernel agrees
    xgr.apply_token_bitmask_inplace(theirs, torch.from_numpy(bitmask[masks]).contiguous())
    assert torch.equal(theirs, got[rows].float())
    assert unpack_bitmask(torch.from_numpy(bitmask), vocab).shape == (R, vocab)


def test_eos_is_allowed_only_where_the_grammar_may_end():
    so = StructuredOutputManager(TOK, 260, EOS)
    so.add_request("r", StructuredOutputsParams(regex="ab?"))
    allowed = lambda: unpack_bitmask(torch.from_numpy(so.grammar_bitmask([("r", "r")]).bitmask), 260)[0]  # noqa
    assert allowed().nonzero()[:, 0].tolist() == [ord("a")]
    assert so.accept("r", ord("a"))
    assert allowed().nonzero()[:, 0].tolist() == [ord("b"), EOS]
    assert so.accept("r", ord("b"))
    assert allowed().nonzero()[:, 0].tolist() == [EOS]
    assert not so.accept("r", ord("b")) and so.accept("r", EOS) and so.is_terminated("r")


def masked_reference(model, prompt, grammar, max_tokens):
    """Greedy decoding by a full recompute at every step, with the grammar's mask
    applied by hand from a matcher of its own."""
    compiled = StructuredOutputManager(TOK, model.config.vocab_size, EOS).compile(grammar)
    matcher, out = xgr.GrammarMatcher(compiled), []
    words = np.zeros((1, (model.config.vocab_size + 31) // 32), dtype=np.int32)
    while len(out) < max_tokens and not matcher.is_terminated():
        row = full_forward_logits(model, prompt + out)[-1].clone()
        matcher.fill_next_token_bitmask(words, 0)
        for t in range(len(row)):
            if not (int(words[0, t // 32]) >> (t % 32)) & 1:
                row[t] = -math.inf
        out.append(int(torch.argmax(row)))
        assert matcher.accept_token(out[-1])
        if out[-1] == EOS:
            break
    return out


GRAMMARS = [StructuredOutputsParams(json=SCHEMAS["nested"]), StructuredOutputsParams(regex=r"[a-f]{3,9}"),
            StructuredOutputsParams(choice=["alpha", "beta", "gamma"])]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [30, 31, 32], [40, 41, 42, 43, 44]]


def test_greedy_constrained_output_equals_a_masked_lone_recompute(tiny64):
    llm = LLM(tiny64, attention_backend=BACKEND, tokenizer=TOK)
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=60, structured_outputs=g) for g in GRAMMARS],
                        use_tqdm=False)
    for p, g, o in zip(PROMPTS, GRAMMARS, outs):
        assert o.outputs[0].token_ids == masked_reference(tiny64, p, g, 60)
    assert_all_memory_back(llm.engine)
    assert not llm.engine.scheduler.structured_output.matchers


# --- the batch and the scheduler ----------------------------------------------------------
FREE = [SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, top_k=20)]
FREE_PROMPTS = [[50, 51, 52, 53, 54, 55, 56], [60, 61, 62]]


def lone(model, prompt, params, **options):
    llm = LLM(model, attention_backend=BACKEND, tokenizer=TOK, **options)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_free_rows_of_a_mixed_batch_get_exactly_their_lone_tokens(tiny64):
    llm = LLM(tiny64, attention_backend=BACKEND, tokenizer=TOK)
    params = [SamplingParams(max_tokens=60, structured_outputs=g) for g in GRAMMARS] + FREE
    outs = llm.generate(PROMPTS + FREE_PROMPTS, params, use_tqdm=False)
    assert outs[3].outputs[0].token_ids == reference_generate(tiny64, FREE_PROMPTS[0], 24)
    assert outs[4].outputs[0].token_ids == lone(tiny64, FREE_PROMPTS[1], FREE[1])
    for p, g, o in zip(PROMPTS, GRAMMARS, outs):           # and the constrained rows theirs
        assert o.outputs[0].token_ids == lone(tiny64, p, SamplingParams(max_tokens=60, structured_outputs=g))
    assert llm.engine.trace.column("num_scheduled").max() == 5


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_each_matcher_in_step(tiny64, mode):
    """Recomputed requests re-prefill their outputs but accept nothing twice."""
    opts = dict(block_size=4, num_kv_blocks=22, watermark=0.0, preemption_mode=mode, swap_space_bytes=2**22)
    llm = LLM(tiny64, attention_backend=BACKEND, tokenizer=TOK, **opts)
    params = [SamplingParams(max_tokens=60, structured_outputs=g) for g in GRAMMARS] + FREE
    outs = llm.generate(PROMPTS + FREE_PROMPTS, params, use_tqdm=False)
    assert sum(len(s.preempted) for s in llm.engine.trace) > 0
    for p, g, o in zip(PROMPTS, GRAMMARS, outs):
        assert o.outputs[0].token_ids == masked_reference(tiny64, p, g, 60)
    assert outs[3].outputs[0].token_ids == reference_generate(tiny64, FREE_PROMPTS[0], 24)
    assert_all_memory_back(llm.engine)


def test_chunked_prefill_and_the_prefix_cache_leave_masks_alone(tiny64):
    shared = list(range(70, 110))
    prompts = [shared + [1], shared + [2], shared + [3]]
    llm = LLM(tiny64, attention_backend=BACKEND, tokenizer=TOK, max_num_batched_tokens=16, max_num_seqs=8,
              block_size=4)
    params = [SamplingParams(max_tokens=60, structured_outputs=g) for g in GRAMMARS]
    outs = llm.generate(prompts, params, arrival_times=[0.0, 0.0, 0.5], use_tqdm=False)
    assert llm.engine.requests["2"].num_cached_tokens > 0            # the third found the shared prefix
    assert sum(s.prefill_tokens > 0 for s in llm.engine.trace) > len(prompts)   # prompts came in chunks
    for p, g, o in zip(prompts, GRAMMARS, outs):
        assert o.outputs[0].token_ids == masked_reference(tiny64, p, g, 60)


def test_parallel_samples_each_follow_their_own_matcher(tiny64):
    g = StructuredOutputsParams(regex=r"[a-z]{2,6}")
    llm = LLM(tiny64, attention_backend=BACKEND, tokenizer=TOK)
    out = llm.generate([PROMPTS[1]], SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=3,
                                                    structured_outputs=g), use_tqdm=False)[0]
    texts = [o.text for o in out.outputs]
    assert all(re.fullmatch(r"[a-z]{2,6}", t) for t in texts) and len(set(texts)) > 1
    for k, o in enumerate(out.outputs):                 # sample k is the lone request seeded seed + k
        assert o.token_ids == lone(tiny64, PROMPTS[1], SamplingParams(max_tokens=20, temperature=1.0, seed=3 + k,
                                                                      structured_outputs=g))
    assert_all_memory_back(llm.engine)
    assert not llm.engine.scheduler.structured_output.matchers


def test_speculative_decoding_skips_constrained_requests(tiny64):
    """A constrained request is not speculated (said in speculable()); the others still are."""
    rep = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    spec = SpeculativeConfig("draft_model", 3, draft_model=tiny64)     # it proposes what the target would pick
    llm = LLM(tiny64, attention_backend=BACKEND, tokenizer=TOK, speculative=spec)
    g = GRAMMARS[1]
    outs = llm.generate([rep, rep], [SamplingParams(max_tokens=30, structured_outputs=g),
                                     SamplingParams(max_tokens=12, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == masked_reference(tiny64, rep, g, 30)
    assert outs[1].outputs[0].token_ids == reference_generate(tiny64, rep, 12)
    assert sum(s.spec_proposed for s in llm.engine.trace) > 0
    assert all(lane.num_tokens == 1 for s in llm.engine.trace for lane in s.lanes
               if lane.request_id == "0" and lane.kind == "decode")


def test_logprobs_are_of_the_raw_distribution(tiny64):
    """The model's log-probabilities before the mask (this engine's choice;
    vLLM's are after it), so tokens the grammar forbids can be listed among the
    top ones."""
    g = StructuredOutputsParams(choice=["alpha", "beta"])
    llm = LLM(tiny64, attention_backend=BACKEND, tokenizer=TOK)
    params = SamplingParams(max_tokens=10, logprobs=5, structured_outputs=g)
    out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    ids = out.token_ids
    lp = torch.log_softmax(full_forward_logits(tiny64, PROMPTS[2] + ids).double(), dim=-1)
    P = len(PROMPTS[2])
    for i, (t, d) in enumerate(zip(ids, out.logprobs)):
        assert d[t].logprob == pytest.approx(lp[P - 1 + i, t].item(), abs=1e-9)
        assert d[t].rank == int((lp[P - 1 + i] > lp[P - 1 + i, t]).sum()) + 1
    first = set(out.logprobs[0])                        # at the start only "a" or "b" may come
    assert first - {ord("a"), ord("b")}


def test_the_step_carries_its_masks_as_plain_data(tiny64):
    engine = Engine(tiny64, attention_backend=BACKEND, tokenizer=TOK)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs=GRAMMARS[0]))
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8))
    sched = engine.scheduler.schedule()
    assert sched.grammar is not None and list(sched.grammar.rows) == ["req-0"]
    assert sched.grammar.bitmask.dtype == np.int32 and sched.grammar.bitmask.shape == (1, (260 + 31) // 32)
    assert pickle.loads(pickle.dumps(sched)) == sched and isinstance(sched, SchedulerOutput)
    assert _tensors_reachable(engine.scheduler) == []
    engine.scheduler.update_from_output(sched, engine.runner.execute(sched))
    engine.run()


# --- params, errors, the cache, the tokenizers ------------------------------------------------
@pytest.mark.parametrize("spec, match", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{"}, "json is not valid JSON"), ({"json": [1]}, "json must be a JSON schema"),
    ({"choice": []}, "choice must be a non-empty list"), ({"choice": "ab"}, "choice must be"),
    ({"regex": ""}, "regex must be a non-empty string"), ({"json_object": "yes"}, "json_object must be true"),
    ({"grammar": 5}, "grammar must be"), ({"schema": {}}, "unknown keys"),
])
def test_params_name_what_is_wrong(spec, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=spec)


def test_params_from_a_dict_and_their_cache_key():
    a = SamplingParams(structured_outputs={"json": {"b": 1, "a": {"type": "object"}}}).structured_outputs
    b = StructuredOutputsParams(json='{"a": {"type": "object"}, "b": 1}')
    assert a.key == b.key and hash(a) == hash(b) and a.kind == "json"
    assert StructuredOutputsParams(json={}, disable_any_whitespace=False).key != StructuredOutputsParams(json={}).key
    assert StructuredOutputsParams(choice=["x"]).choice == ("x",)


@pytest.mark.parametrize("spec, match", [
    ({"regex": "[a-"}, "structured_outputs.regex: .*Unclosed"),
    ({"json": {"type": "nonsense"}}, "structured_outputs.json: .*nonsense"),
    ({"grammar": "root ::= missing"}, "structured_outputs.grammar: .*missing"),
])
def test_grammars_xgrammar_refuses_fail_at_add_request(tiny32, spec, match):
    engine = Engine(tiny32, attention_backend=BACKEND, tokenizer=TOK)
    with pytest.raises(ValueError, match="request r: " + match):
        engine.add_request([1, 2], SamplingParams(structured_outputs=spec), request_id="r")
    assert not engine.has_unfinished()


def test_what_cannot_be_constrained_is_refused(tiny32):
    g = SamplingParams(structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        Engine(tiny32).add_request([1], g)
    with pytest.raises(ValueError, match="simulator computes none"):
        Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b", tokenizer=TOK).add_request([1], g)


def test_compiled_grammars_are_cached_per_tokenizer(tiny32):
    tok = ByteTokenizer()
    llm = LLM(tiny32, attention_backend=BACKEND, tokenizer=tok)
    g = SamplingParams(max_tokens=8, structured_outputs={"regex": "[xy]{2}"})
    llm.generate([[1], [2]], g, use_tqdm=False)
    cache = llm.engine.scheduler.structured_output.grammars
    llm.generate([[3]], g, use_tqdm=False)           # a new engine, the same tokenizer: the same cache
    assert llm.engine.scheduler.structured_output.grammars is cache
    assert (cache.misses, cache.hits) == (1, 5)      # compiled once; found when checked and when added


def test_a_grammar_other_parameters_leave_no_token_for_fails_alone(tiny32):
    """bad_words forbid the one token the grammar allows: that request ends with
    an error that says so; its batch mates go on."""
    engine = Engine(tiny32, attention_backend=BACKEND, tokenizer=TOK)
    stuck = engine.add_request([1, 2], SamplingParams(max_tokens=8, structured_outputs={"choice": ["ab"]},
                                                      bad_words_token_ids=((ord("a"),),)))
    other = engine.add_request([3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.run()
    assert stuck.finish_reason == "error" and "not allowed by its structured_outputs grammar" in stuck.error
    assert stuck.output_token_ids == [] and other.num_output_tokens == 4
    assert not engine.scheduler.structured_output.matchers


def test_aborting_a_constrained_request_frees_its_matcher(tiny32):
    engine = Engine(tiny32, attention_backend=BACKEND, tokenizer=TOK)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=30, structured_outputs=GRAMMARS[0]), request_id="a")
    engine.step()
    assert "a" in engine.scheduler.structured_output
    engine.abort("a")
    assert "a" not in engine.scheduler.structured_output


def test_a_hugging_face_tokenizer_gives_the_same_masks():
    """tiny-py's tokenizer.json read by xgrammar's Hugging Face path (special tokens
    emptied) allows exactly what the byte tokenizer's raw vocabulary allows."""
    pytest.importorskip("transformers")
    hf = HFTokenizer(trained_model_path("tiny-py"))
    g = StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string"},
                                                                       "k": {"enum": ["é", "a b"]}},
                                      "required": ["s", "k"]})
    a, b = StructuredOutputManager(TOK, 260, EOS), StructuredOutputManager(hf, 260, EOS)
    a.add_request("r", g)
    b.add_request("r", g)
    text = json.dumps({"s": 'h\u00e9"<|bos|> x', "k": "é"}, ensure_ascii=False)
    for t in list(text.encode()) + [EOS]:
        assert np.array_equal(a.grammar_bitmask([("r", "r")]).bitmask, b.grammar_bitmask([("r", "r")]).bitmask)
        assert a.accept("r", t) and b.accept("r", t)
    assert a.is_terminated("r") and b.is_terminated("r")
