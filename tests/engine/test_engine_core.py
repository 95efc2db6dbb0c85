"""The engine core: one owner for request state, the full engine by default, and
the edge cases a new user runs into (each found by trying, each failed before
the fix)."""
import math
import os
import random
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch_engine import LLM, Engine, EngineConfig, SamplingParams, SpeculativeConfig, reference_generate
from minibatch_engine.sampling import sampler as sampling_module
from minibatch_engine.entrypoints.cli import main
from minibatch_engine.kv import KVCacheManager, PagedKVCache, ReservedKVCache
from minibatch_engine.model import build_model, get_preset
from minibatch_engine.core.request import RequestStatus
from minibatch_engine.speculative.proposer import Proposer

from ..conftest import SIM, assert_all_memory_back



# --- structure ------------------------------------------------------------------------
def test_defaults_are_the_full_engine(tiny32):
    engine = Engine(tiny32)
    cfg = engine.config
    assert (cfg.scheduler, cfg.kv_layout, cfg.enable_chunked_prefill, cfg.enable_prefix_caching) == \
        ("continuous", "paged", True, True)
    assert cfg.max_num_seqs == 256 and cfg.max_num_batched_tokens == 2048
    llm = LLM(tiny32)
    assert llm.config.scheduler == "continuous" and llm.config.kv_layout == "auto"     # decided by the engine
    # the pool is bounded by memory (512 MiB on the CPU), not by 256 x max_model_len tokens
    assert engine.kv_cache.capacity_bytes <= 512 * 2**20


def test_both_caches_implement_the_one_interface(tiny32):
    paged = PagedKVCache(tiny32.config, num_blocks=4, block_size=4)
    reserved = ReservedKVCache(tiny32.config, num_rows=2, max_model_len=16)
    for cache in (paged, reserved):
        assert isinstance(cache, KVCacheManager)
        assert not cache.find_cached_prefix([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="paged"):
        reserved.fork("a", "b")
    with pytest.raises(ValueError, match="paged"):
        reserved.swap_out("a", None)


def test_step_is_schedule_execute_update(tiny32):
    """The runner never changes a request; the scheduler's update does."""
    engine = Engine(tiny32, max_num_seqs=2, max_model_len=32)
    r = engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    sched = engine.scheduler.schedule()
    before = (r.num_computed_tokens, list(r.output_token_ids))
    out = engine.runner.execute(sched)
    assert (r.num_computed_tokens, list(r.output_token_ids)) == before
    assert list(out.sampled_token_ids) == [r.request_id]
    engine.scheduler.update_from_output(sched, out)
    assert r.num_computed_tokens == 3 and len(r.output_token_ids) == 1


def test_overrides_are_applied_or_refused(tiny32):
    base = EngineConfig(max_num_seqs=4)
    assert Engine(tiny32, base, max_num_seqs=2).config.max_num_seqs == 2
    assert base.max_num_seqs == 4
    with pytest.raises(TypeError, match="max_batch"):
        Engine(tiny32, base, max_batch=2)


@pytest.mark.parametrize("options, field", [
    ({"scheduler": "fcfs"}, "scheduler"), ({"max_num_seqs": 2.5}, "max_num_seqs"),
    ({"block_size": 4.0}, "block_size"), ({"num_kv_blocks": 1.5}, "num_kv_blocks"),
    ({"kv_layout": "slot"}, "kv_layout"), ({"max_num_batched_tokens": "many"}, "max_num_batched_tokens"),
    ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill"), ({"watermark": 1.0}, "watermark"),
    ({"scheduler": "static", "kv_layout": "paged"}, "reserved"),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 16}, "max_num_batched_tokens"),
])
def test_llm_refuses_bad_config_at_construction(tiny32, options, field):
    with pytest.raises((ValueError, TypeError), match=field):
        LLM(tiny32, **options)


# --- edge cases, each with the behaviour it had before --------------------------------
def test_aborting_an_n_gt_1_parent_ends_its_samples(tiny64):
    """Before: the forked children kept running after the parent was aborted."""
    engine = Engine(tiny64, max_num_seqs=4, max_model_len=64, block_size=4)
    parent = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=20, n=3, ignore_eos=True))
    other = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    engine.step()
    samples = engine.samples_of(parent.request_id)
    assert len(samples) == 3 and all(s.status == RequestStatus.RUNNING for s in samples)
    ended = engine.abort(parent.request_id)
    assert {r.request_id for r in ended} == {s.request_id for s in samples}
    assert all(s.finish_reason == "abort" for s in samples)
    engine.run()
    assert other.output_token_ids == reference_generate(tiny64, [1, 2, 3], 6)
    assert_all_memory_back(engine)


def test_static_batching_gives_every_row_back(tiny64):
    """Before: the last batch kept its KV rows after run() (the test said <= 1)."""
    engine = Engine(tiny64, scheduler="static", max_num_seqs=3, max_model_len=64)
    for p, g in (([1, 2], 3), ([3], 5), ([4, 5, 6], 2), ([7], 4)):
        engine.add_request(p, SamplingParams(max_tokens=g, ignore_eos=True))
    engine.run()
    assert engine.kv_cache.num_used_blocks == 0 and engine.kv_cache.reserved_bytes == 0


def test_n_gt_1_counts_against_max_num_seqs():
    """Before: two n=3 requests with max_num_seqs=4 ran 6 sequences at once."""
    engine = Engine(None, max_num_seqs=4, max_model_len=64, **SIM)
    for _ in range(2):
        engine.add_request([1] * 8, SamplingParams(max_tokens=6, n=3, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3


def test_llm_takes_the_tokenizer_from_where_the_model_came_from(tiny32):
    """Before: LLM(<Transformer>) always used the byte tokenizer."""
    assert LLM(tiny32).tokenizer.eos_token_id == get_preset("tiny").eos_token_id
    custom = build_model(get_preset("tiny").with_(name="custom"), device="cpu")
    llm = LLM(custom)
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].text is None and len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text"], use_tqdm=False)


def test_checkpoint_without_tokenizer_runs_token_ids(tmp_path):
    """Before: LLM(path) refused a checkpoint without tokenizer.json."""
    from safetensors.torch import save_file
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    hf.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), device="cpu")
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].text is None and len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)


def test_tiny_temperatures_are_greedy(tiny32):
    """Before: temperature=1e-38 crashed in sampling (logits / T overflowed)."""
    llm = LLM(tiny32, max_num_seqs=2)
    greedy = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5), use_tqdm=False)[0].outputs[0].token_ids
    tiny = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=1e-38, seed=1),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert tiny == greedy


@pytest.mark.parametrize("times, match", [
    ([1e30], "arrival_times"), ([math.inf], "arrival_times"), ([math.nan], "arrival_times"),
    ([-1.0], "arrival_times"), ([0.0, 0.0], "one per prompt"), (["soon"], "arrival_times"),
])
def test_arrival_times_are_checked(tiny32, times, match):
    """Before: a huge value slept for years, inf overflowed, nan meant 'now'.
    (Past 1e9 s a time is refused in every clock: test_reliability.py.)"""
    llm = LLM(tiny32, max_num_seqs=2)
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2]], arrival_times=times, use_tqdm=False)


@pytest.mark.parametrize("prompt", [[1.7, 2.0], ["5"], [True, 3], [[1, 2]], [None]])
def test_token_ids_must_be_integers(tiny32, prompt):
    """Before: [1.7, 2.0] became [1, 2]; '5' and True were accepted."""
    engine = Engine(tiny32, max_num_seqs=2)
    with pytest.raises(TypeError, match="integers|token ids"):
        engine.add_request(prompt, SamplingParams(max_tokens=1))


def test_integer_numpy_and_tensor_token_ids_are_accepted(tiny32):
    engine = Engine(tiny32, max_num_seqs=2)
    a = engine.add_request(np.array([1, 2, 3]), SamplingParams(max_tokens=1))
    b = engine.add_request([torch.tensor(1), np.int64(2), 3], SamplingParams(max_tokens=1))
    assert a.prompt_token_ids == b.prompt_token_ids == [1, 2, 3]
    with pytest.raises(TypeError, match="integers"):
        engine.add_request(torch.tensor([1.0, 2.0]), SamplingParams(max_tokens=1))


@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.generate([[1]], {"max_tokens": 3}), "SamplingParams"),
    (lambda llm: llm.generate(None), "None"),
    (lambda llm: llm.generate([None]), r"prompts\[0\]"),
    (lambda llm: llm.generate(np.array([1, 2])), "ambiguous"),
    (lambda llm: llm.generate(torch.tensor([1, 2])), "ambiguous"),
    (lambda llm: llm.generate(p for p in ["a"]), "generator|list"),
    (lambda llm: SamplingParams(temperature="0.5"), "temperature"),
    (lambda llm: SamplingParams(max_tokens=None), "max_tokens"),
    (lambda llm: SamplingParams(top_p=None), "top_p"),
    (lambda llm: SamplingParams(stop_token_ids=5), "stop_token_ids"),
    (lambda llm: LLM("tiny", device="tpu"), "tpu"),
    (lambda llm: LLM("llama-3-8b"), "shape-only preset"),
    (lambda llm: LLM("/no/such/dir"), "not 'tiny'"),
])
def test_clear_errors_instead_of_raw_type_errors(tiny32, call, match):
    llm = LLM(tiny32, max_num_seqs=2)
    with pytest.raises((ValueError, TypeError), match=match):
        call(llm)


def test_bad_config_json_names_the_key(tmp_path):
    import json
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="object"):
        LLM(str(tmp_path))
    good = {"model_type": "llama", "vocab_size": 64, "hidden_size": "32", "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(good))
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("argv, match", [
    (["bench", "--model", "llama-3-8b", "--num-requests", "2", "--no-progress"], "shape-only"),
    (["bench", "--model", "/no/such/checkpoint", "--no-progress"], "checkpoint"),
    (["simulate", "--max-batch", "0", "--no-progress"], "--max-batch"),
    (["simulate", "--block-size", "0", "--no-progress"], "--block-size"),
    (["simulate", "--scheduler", "static", "--kv", "paged", "--no-progress"], "reserved"),
    (["generate", "hi", "--temperature", "-1", "--no-progress"], "temperature"),
    (["generate", "hi", "--device", "tpu", "--no-progress"], "tpu"),
])
def test_cli_user_errors_exit_2_with_a_message(capsys, argv, match):
    """Before: some of these ended in a traceback and exit status 1."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and "Traceback" not in err


# --- aborts in every state ----------------------------------------------------------------
def _abort_when(tiny64, engine_kwargs, predicate, prompts, max_tokens=12):
    engine = Engine(tiny64, max_model_len=64, **engine_kwargs)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    victim = None
    for _ in range(500):
        if not engine.has_unfinished():
            break
        if victim is None:
            victim = next((r for r in reqs if predicate(engine, r)), None)
            if victim is not None:
                engine.abort(victim.request_id)
                assert victim.finish_reason == "abort" and engine.kv_cache.first_block(victim.request_id) == -1
        engine.step()
    assert victim is not None, "the state was never reached"
    for r, p in zip(reqs, prompts):
        if r is not victim:
            assert r.output_token_ids == reference_generate(tiny64, p, max_tokens)
    assert_all_memory_back(engine)


PROMPTS = [list(range(1 + i, 14 + i)) for i in range(4)]


@pytest.mark.parametrize("state", ["waiting", "mid-chunk", "decoding", "swapped", "preempted"])
def test_abort_in_every_state_gives_all_memory_back(tiny64, state):
    tight = dict(num_kv_blocks=10, block_size=4, watermark=0.0, max_num_seqs=4)
    cases = {
        "waiting": (dict(max_num_seqs=1), lambda e, r: r.status == RequestStatus.WAITING and r.num_computed_tokens == 0
                    and e.scheduler.running),
        "mid-chunk": (dict(max_num_seqs=4, max_num_batched_tokens=4),
                      lambda e, r: 0 < r.num_computed_tokens < r.num_prompt_tokens),
        "decoding": (dict(max_num_seqs=4), lambda e, r: r.num_output_tokens >= 2 and not r.is_finished),
        "swapped": (dict(tight, preemption_mode="swap", swap_space_bytes=2**20),
                    lambda e, r: r in e.scheduler.swapped),
        "preempted": (dict(tight), lambda e, r: r.status == RequestStatus.PREEMPTED),
    }
    kwargs, predicate = cases[state]
    _abort_when(tiny64, kwargs, predicate, PROMPTS)


def test_abort_a_forked_sample_alone(tiny64):
    engine = Engine(tiny64, max_num_seqs=4, max_model_len=64, block_size=4)
    parent = engine.add_request([3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=10, n=2, ignore_eos=True))
    engine.step()
    child = engine.samples_of(parent.request_id)[1]
    engine.abort(child.request_id)
    engine.run()
    assert parent.finish_reason == "length" and child.finish_reason == "abort"
    assert parent.output_token_ids == reference_generate(tiny64, [3, 4, 5, 6, 7, 8], 10)
    assert_all_memory_back(engine)


# --- every knob together, in float64 ----------------------------------------------------
class OracleProposer(Proposer):
    """Proposals for the fuzz: the lone recompute's own next tokens, corrupted at
    a random place half of the time, so that steps verify full, partial and
    empty acceptances (the n-gram proposer rarely proposes on short runs)."""

    def __init__(self, k, model, rng, kv_cache_dtype="auto"):
        super().__init__(k)
        self.model, self.rng, self.refs, self.kv = model, rng, {}, kv_cache_dtype

    def propose(self, seqs):
        out = {}
        for s in seqs:
            k = self.rng.randint(0, s.num_proposals)
            if k == 0:
                continue
            key = tuple(s.token_ids[:s.num_prompt_tokens])
            if key not in self.refs:
                self.refs[key] = reference_generate(self.model, list(key), 16, self.kv)
            done = s.num_tokens - s.num_prompt_tokens
            guess = (self.refs[key][done:done + k] + [0] * k)[:k]
            if self.rng.random() < 0.5:
                guess[self.rng.randrange(k)] = self.rng.randrange(256)
            out[s.request_id] = guess
        return out


@settings(max_examples=int(os.environ.get("CORE_EXAMPLES", 20)), deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 16]), extra_blocks=st.integers(0, 8),
       chunked=st.booleans(), budget=st.sampled_from([None, 4, 8, 64]),
       mode=st.sampled_from(["recompute", "swap"]), prefix=st.booleans(), B=st.integers(1, 4),
       k=st.sampled_from([0, 0, 1, 2, 3]), policy=st.sampled_from(["fcfs", "priority"]),
       kv=st.sampled_from(["auto", "auto", "fp8", "int8"]))
def test_every_knob_together_matches_the_lone_recompute(tiny64, data, block_size, extra_blocks, chunked,
                                                        budget, mode, prefix, B, k, policy, kv):
    """Mid-run arrivals, aborts, n > 1 forks, speculative verification (k > 0),
    preemption by recompute or swap, priorities, a quantized KV cache (fp8, int8):
    every sample's greedy tokens are the lone recompute's (through the same
    quantized cache), no step runs more than max_num_seqs sequences, and all
    memory comes back. Without speculation, some requests sample (seeded, with
    top-k and top-p, their logits rounded to bfloat16 so that ties are common):
    each draws the same tokens as it does alone (with the same cache)."""
    with mock.patch.object(sampling_module, "sampling_probs", _bf16_sampling_probs):
        _every_knob_together(tiny64, data, block_size, extra_blocks, chunked, budget, mode, prefix, B, k,
                             policy, kv)


_real_sampling_probs = sampling_module.sampling_probs


def _bf16_sampling_probs(logits, params):
    """The sampler's distributions from logits rounded to bfloat16 (ties)."""
    return _real_sampling_probs(logits.to(torch.bfloat16).to(logits.dtype), params)


def _sampled_params(data, g, n):
    return SamplingParams(max_tokens=g, n=n, ignore_eos=True, temperature=data.draw(st.sampled_from([0.7, 1.5])),
                          top_k=data.draw(st.sampled_from([0, 2, 5, 40])),
                          top_p=data.draw(st.sampled_from([1.0, 0.5, 0.9])), seed=data.draw(st.integers(0, 2**20)))


def _every_knob_together(tiny64, data, block_size, extra_blocks, chunked, budget, mode, prefix, B, k, policy,
                         kv):
    max_model_len = 40
    if budget is not None:
        budget = max(budget, B) if chunked else max(budget, max_model_len)
    blocks = -(-max_model_len // block_size) + extra_blocks
    engine = Engine(tiny64, max_num_seqs=B, max_model_len=max_model_len, block_size=block_size,
                    num_kv_blocks=blocks, watermark=0.0, enable_chunked_prefill=chunked,
                    max_num_batched_tokens=budget, preemption_mode=mode, enable_prefix_caching=prefix,
                    swap_space_bytes=data.draw(st.integers(0, 12)) * block_size * 4096 * 2, policy=policy,
                    speculative=SpeculativeConfig("ngram", k) if k else None, kv_cache_dtype=kv)
    if k:
        engine.runner.proposer = OracleProposer(k, tiny64, random.Random(data.draw(st.integers(0, 2**16))), kv)
    shared = [7, 7, 1, 2, 3, 4, 5, 6]           # a common prefix makes prefix hits likely
    specs = data.draw(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 12), st.integers(1, 3),
                                         st.integers(0, 6), st.integers(0, 2)), min_size=1, max_size=6))
    prompts, reqs, arrivals = {}, [], sorted(range(len(specs)), key=lambda i: specs[i][3])
    aborts = set(data.draw(st.lists(st.integers(0, 30), max_size=2)))
    step, pending = 0, list(arrivals)
    while pending or engine.has_unfinished():
        while pending and specs[pending[0]][3] <= step:       # mid-run arrivals, on the step clock
            i = pending.pop(0)
            extra, g, n, _, priority = specs[i]
            prompt = shared[: 1 + extra % 8] + [100 + i] * extra
            n = n if n <= B else 1
            sampled = not k and data.draw(st.booleans())
            params = _sampled_params(data, g, n) if sampled else SamplingParams(max_tokens=g, n=n, ignore_eos=True)
            r = engine.add_request(prompt, params, priority=priority)
            prompts[r.request_id] = (prompt, params)
            reqs.append(r)
        if step in aborts and reqs:
            target = reqs[data.draw(st.integers(0, len(reqs) - 1))]
            engine.abort(target.request_id)
        engine.step()
        assert engine.scheduler.num_seqs() <= B, "more sequences running than max_num_seqs"
        batch = engine.runner.input_batch   # the runner's persistent batch holds every running request:
        for r in engine.scheduler.running:  # its tokens up to the last computed or sampled one, its blocks
            state = batch[r.request_id]
            copy = state.token_ids
            assert copy == r.all_token_ids[:len(copy)] and len(copy) >= r.num_computed_tokens
            table = list(engine.kv_cache.block_table(r.request_id))   # (rollback may have cut its tail since)
            assert state.block_table[:len(table)] == table
        step += 1
        assert step < 3000, "no progress"
    for r in reqs:
        prompt, params = prompts[r.request_id]
        if params.greedy:
            want = [reference_generate(tiny64, prompt, params.max_tokens, kv)] * params.n
        else:                   # a seeded sampled request: its tokens alone
            alone = Engine(tiny64, max_num_seqs=params.n, max_model_len=max_model_len, kv_cache_dtype=kv)
            lone = alone.add_request(prompt, params)
            alone.run()
            want = [s.output_token_ids for s in alone.samples_of(lone.request_id)]
        for sample, tokens in zip(engine.samples_of(r.request_id), want):
            if sample.finish_reason != "abort":
                assert sample.output_token_ids == tokens
    assert_all_memory_back(engine)


def test_trained_models_load_by_name_with_their_tokenizer():
    llm = LLM("tiny-py", max_num_seqs=2)
    assert type(llm.tokenizer).__name__ == "ByteTokenizer"
    out = llm.generate(["def "], SamplingParams(max_tokens=8), use_tqdm=False)[0]
    assert isinstance(out.outputs[0].text, str) and len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize("max_model_len", [96, 100, 1024])
def test_sdpa_reads_reserved_rows_in_pieces_and_stays_exact(tiny64, max_model_len):
    """A reserved row is one big block; the sdpa backend gathers it in smaller
    pieces (gcd with 64 slots) and must give the same tokens."""
    engine = Engine(tiny64, scheduler="continuous", kv_layout="reserved", max_num_seqs=3,
                    max_model_len=max_model_len, attention_backend="sdpa")
    prompts = [[1, 2, 3, 4, 5], list(range(10, 40)), [7]]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    engine.run()
    assert [r.output_token_ids for r in reqs] == [reference_generate(tiny64, p, 12) for p in prompts]
