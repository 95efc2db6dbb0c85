"""Reliability: the bugs an outside probe found (issue 24), each with a test that
failed before its fix, and the error contract for bad input (API: ValueError or
TypeError naming the field; CLI: one line and exit status 2)."""
import asyncio
import dataclasses
import threading

import numpy as np
import pytest
import torch

from minibatch_engine import (AsyncLLM, Engine, LLM, SamplingParams, SpeculativeConfig,
                              reference_generate)
from minibatch_engine.sampling import sampler as sampling_module
from minibatch_engine.entrypoints.cli import main
from minibatch_engine.harness.metrics import request_metrics

from ..conftest import assert_all_memory_back


# --- 1. wrong tokens: an n > 1 fork in the same step as a verification -------------------
def test_forked_samples_beside_a_verification_read_their_own_logits(tiny64):
    """A request verifying one proposal (2 logits rows) and an n = 3 request
    forking in the same step (1 row, read 3 times) make 3 sampled rows out of
    3 logits rows: the runner took that for "every row in order" and sample i
    read row i, so two samples took the verifier's rows."""
    engine = Engine(tiny64, max_num_seqs=8, max_model_len=128, block_size=4,
                    speculative=SpeculativeConfig("ngram", 1, prompt_lookup_min=1, prompt_lookup_max=2))
    long = engine.add_request([1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(15):             # the tiny model falls into a loop: n-gram lookup proposes from here on
        engine.step()
    forked = engine.add_request([9, 10, 11], SamplingParams(max_tokens=6, n=3, ignore_eos=True))
    engine.step()
    last = engine.trace[-1]
    assert last.num_verifications == 1 and last.sampled_tokens >= 3    # the case: both in one step
    engine.run()
    ref = reference_generate(tiny64, [9, 10, 11], 6)
    assert [s.output_token_ids for s in engine.samples_of(forked.request_id)] == [ref] * 3
    assert long.output_token_ids == reference_generate(tiny64, [1, 2, 3], 60)


# --- 2. sampling values that used to crash the batch ---------------------------------------
def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(tiny64):
    """top_p = 1e-46 is 0 in float32: every token was masked, multinomial raised
    inside step() and the healthy request beside it was lost."""
    llm = LLM(tiny64, max_num_seqs=2)
    outs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_tokens=4, temperature=1.0, top_p=1e-46, seed=1),
                                              SamplingParams(max_tokens=4)])
    assert outs[0].outputs[0].token_ids == reference_generate(tiny64, [5, 6, 7], 4)     # only the top token is left
    assert outs[1].outputs[0].token_ids == reference_generate(tiny64, [8, 9], 4)


@pytest.mark.parametrize("kwargs", [dict(seed=2**64), dict(seed=2**64 - 2, n=3), dict(seed=-1)])
def test_seeds_a_generator_cannot_take_are_refused_up_front(kwargs):
    with pytest.raises(ValueError, match="SamplingParams.seed"):
        SamplingParams(**kwargs)
    SamplingParams(seed=2**64 - 2, n=2)          # its samples use seed and seed + 1: both fit


def _fail_sampling_of(monkeypatch, top_k: int):
    """Make the distributions of requests with this top_k NaN (what non-finite logits give)."""
    real = sampling_module.sampling_probs

    def probs(logits, params):
        bad = torch.tensor([p.top_k == top_k for p in params])
        return real(logits, params).masked_fill(bad[:, None], float("nan"))
    monkeypatch.setattr(sampling_module, "sampling_probs", probs)


def test_a_failing_sample_ends_its_request_not_the_batch(tiny64, monkeypatch):
    _fail_sampling_of(monkeypatch, top_k=7)
    llm = LLM(tiny64, max_num_seqs=4)
    bad = SamplingParams(max_tokens=5, temperature=1.0, top_k=7, seed=0)
    outs = llm.generate([[5, 6, 7], [8, 9], [1, 2]], [bad, SamplingParams(max_tokens=5),
                                                       SamplingParams(max_tokens=5, n=2)])
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    assert "sampling failed" in llm.engine.requests["0"].error
    assert outs[0].metrics.ttft_steps is None
    assert outs[1].outputs[0].token_ids == reference_generate(tiny64, [8, 9], 5)
    assert [o.token_ids for o in outs[2].outputs] == [reference_generate(tiny64, [1, 2], 5)] * 2
    assert_all_memory_back(llm.engine)


def test_a_failing_stream_ends_alone_and_the_server_goes_on(tiny64, monkeypatch):
    _fail_sampling_of(monkeypatch, top_k=7)
    llm = AsyncLLM(tiny64, max_num_seqs=4)

    async def collect(prompt, params):
        return [o async for o in llm.stream(prompt, params)]

    async def main_():
        bad, good = await asyncio.gather(
            collect([5, 6, 7], SamplingParams(max_tokens=5, temperature=1.0, top_k=7, seed=0)),
            collect([8, 9], SamplingParams(max_tokens=5)))
        later = await collect([8, 9], SamplingParams(max_tokens=5))
        await llm.shutdown()
        return bad, good, later
    bad, good, later = asyncio.run(main_())
    assert [o.finish_reason for o in bad] == ["error"] and bad[0].token_id is None
    ref = reference_generate(tiny64, [8, 9], 5)
    assert [o.token_id for o in good] == ref == [o.token_id for o in later]


# --- 3. sample ids and user ids --------------------------------------------------------
def test_user_ids_cannot_take_the_form_of_sample_ids(tiny64):
    """"a#1" used to be accepted; when "a" (n = 2) forked, step() raised and run() looped forever."""
    engine = Engine(tiny64, max_num_seqs=4, max_model_len=64)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, n=2), request_id="a")
    for rid in ("a#1", "x#0", "#12"):
        with pytest.raises(ValueError, match="reserved"):
            engine.add_request([4, 5], SamplingParams(max_tokens=3), request_id=rid)
    engine.add_request([4, 5], SamplingParams(max_tokens=3), request_id="a#b")    # not a sample's form
    engine.run()
    assert [s.request_id for s in engine.samples_of("a")] == ["a", "a#1"]


# --- 4. max_num_seqs after a swap-in ---------------------------------------------------------
def test_a_swapped_out_n_gt_1_request_waits_for_room_for_all_its_samples(tiny64):
    """An unforked n = 2 request swapped out mid-prefill came back when one
    sequence slot was free, then forked: 3 sequences ran with max_num_seqs = 2."""
    engine = Engine(tiny64, max_num_seqs=2, max_model_len=64, block_size=4, policy="priority",
                    preemption_mode="swap", swap_space_bytes=2**20, max_num_batched_tokens=16)
    parent = engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=4, n=2, ignore_eos=True),
                                priority=1)
    engine.step()
    urgent = engine.add_request([3, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True), priority=0)
    swapped_in = False
    while engine.has_unfinished():
        engine.step()
        swapped_in |= bool(engine.trace[-1].swap_bytes) and engine.trace[-1].step > 1
        assert engine.scheduler.num_seqs() <= 2
    assert engine.trace[1].preempted and swapped_in          # the case did happen
    assert urgent.output_token_ids == reference_generate(tiny64, [3, 4, 5], 12)
    ref = reference_generate(tiny64, list(range(1, 21)), 4)
    assert [s.output_token_ids for s in engine.samples_of(parent.request_id)] == [ref, ref]


# --- 5. AsyncLLM's lifecycle ---------------------------------------------------------------
def test_shutdown_after_an_engine_failure_returns_and_later_streams_are_refused(tiny32, monkeypatch):
    llm = AsyncLLM(tiny32, max_num_seqs=2)
    monkeypatch.setattr(llm.engine, "step", lambda: 1 / 0)

    async def main_():
        with pytest.raises(ZeroDivisionError):
            async for _ in llm.stream([1, 2], SamplingParams(max_tokens=2)):
                pass
        await llm.shutdown()                    # used to re-raise the failure and never shut down
        await llm.shutdown()                    # a second call does nothing
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in llm.stream([1, 2], SamplingParams(max_tokens=2)):
                pass
    asyncio.run(main_())


def test_a_stream_after_shutdown_is_refused_clearly(tiny32):
    llm = AsyncLLM(tiny32, max_num_seqs=2)

    async def main_():
        out = [o.token_id async for o in llm.stream([1, 2], SamplingParams(max_tokens=2))]
        await llm.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in llm.stream([1, 2], SamplingParams(max_tokens=2)):
                pass
        return out
    assert len(asyncio.run(main_())) == 2


def test_a_second_event_loop_gets_a_clear_error_and_the_first_goes_on(tiny32):
    """Two threads, each with its own event loop: the second used to replace the
    loop's wake-up event, and the first loop then failed for good ("bound to a
    different event loop")."""
    llm = AsyncLLM(tiny32, max_num_seqs=2)
    started, second_done = threading.Event(), threading.Event()
    results = {}

    async def first():
        toks = []
        async for o in llm.stream([1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True)):
            toks.append(o.token_id)
            if len(toks) == 1:
                started.set()
                while not second_done.is_set():
                    await asyncio.sleep(0.01)
        return toks

    async def second():
        try:
            async for _ in llm.stream([4, 5], SamplingParams(max_tokens=2)):
                pass
        except RuntimeError as e:
            return str(e)

    t = threading.Thread(target=lambda: results.update(first=asyncio.run(first())))
    t.start()
    assert started.wait(60)
    results["second"] = asyncio.run(second())
    second_done.set()
    t.join(60)
    assert "another event loop" in results["second"]
    assert results["first"] == reference_generate(tiny32, [1, 2, 3], 30)

    async def later():                          # once the first loop has ended, a new one may serve
        toks = [o.token_id async for o in llm.stream([4, 5], SamplingParams(max_tokens=2))]
        await llm.shutdown()
        return toks
    assert asyncio.run(later()) == reference_generate(tiny32, [4, 5], 2)


# --- 6. the CLI: one line and exit 2 -----------------------------------------------------------
@pytest.mark.parametrize("argv, match", [
    (["bench", "--json", "{tmp}", "--no-progress"], "is a directory"),
    (["sweep", "--rates", "1", "--jsonl", "{tmp}", "--no-progress"], "is a directory"),
    (["simulate", "--json", "{tmp}/no/such/file.json"], "does not exist"),
    (["bench", "--device", "meta", "--num-requests", "2", "--no-progress"], "meta"),
    (["bench", "--vs-transformers", "--rounds", "0"], "--rounds"),
    (["bench", "--vs-transformers", "--threads", "0"], "--threads"),
    (["simulate", "--slo-ttft-ms", "-1"], "--slo-ttft-ms"),
    (["simulate", "--slo-e2e-ms", "nan"], "--slo-e2e-ms"),
    (["sweep", "--rates", "inf", "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b"], "finite"),
    (["simulate", "--seed", str(2**64)], "--seed"),
    (["generate", "hi", "--seed", str(2**64)], "--seed"),
    (["simulate", "--num-requests", "0"], "--num-requests"),
    (["simulate", "--arrival-rate", "inf"], "--arrival-rate"),
    (["simulate", "--no-such-option"], "unrecognized"),
])
def test_cli_bad_values_print_one_line_and_exit_2(capsys, tmp_path, argv, match):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# --- 7. API nits -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**70, 1.5, -1, True])
def test_model_seeds_are_checked(seed):
    with pytest.raises(ValueError, match="seed"):
        LLM(seed=seed)


def test_engine_refuses_a_dict_config(tiny32):
    with pytest.raises(TypeError, match="EngineConfig"):
        Engine(tiny32, {"max_num_seqs": 2})


def test_stop_token_ids_take_numpy_integers_as_prompts_do(tiny64):
    ref = reference_generate(tiny64, [5, 6, 7], 6)
    p = SamplingParams(max_tokens=6, stop_token_ids=[np.int64(ref[2])])
    assert p.stop_token_ids == (ref[2],) and type(p.stop_token_ids[0]) is int
    out = LLM(tiny64, max_num_seqs=1).generate([[5, 6, 7]], p)[0]
    assert out.outputs[0].token_ids == ref[:3] and out.outputs[0].finish_reason == "stop"


def test_sampling_params_cannot_be_changed_past_their_checks():
    """max_tokens = 0 set afterwards used to give one token; temperature = nan crashed the step."""
    p = SamplingParams(max_tokens=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 0
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=float("nan"))


@pytest.mark.parametrize("clock", [{}, dict(sim_gpu="H100-SXM", sim_model="llama-3-8b")])
def test_absurd_arrival_times_are_refused(tiny32, clock):
    engine = Engine(tiny32, max_num_seqs=2, **clock)
    with pytest.raises(ValueError, match="arrival_time"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2), arrival_time=1e300)


def test_text_that_is_not_unicode_is_refused_by_name(tiny32):
    llm = LLM(tiny32, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"prompts\[1\].*UTF-8"):
        llm.generate(["fine", "lone \ud800 surrogate"])


def test_metrics_of_a_request_aborted_before_its_first_token(tiny32):
    engine = Engine(tiny32, max_num_seqs=1)
    first = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    queued = engine.add_request([4, 5], SamplingParams(max_tokens=3))
    engine.step()
    engine.abort(queued.request_id)
    engine.run()
    m = request_metrics(queued, engine.trace)
    assert (m.num_output_tokens, m.ttft_steps, m.queue_steps, m.itl_steps) == (0, None, None, [])
    assert request_metrics(first, engine.trace).ttft_steps == 1


# --- the scheduler/runner boundary: plain data (issue 25) ---------------------------------------
PLAIN = (int, float, str, bool, type(None))


def assert_plain(value, where="SchedulerOutput"):
    """Only ints, floats, strings, lists, tuples, dicts and dataclasses of those."""
    if isinstance(value, PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_plain(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            assert_plain(k, where)
            assert_plain(v, f"{where}[{k!r}]")
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            assert_plain(getattr(value, f.name), f"{where}.{f.name}")
    else:
        raise AssertionError(f"{where} holds a {type(value).__name__}: not plain data")


@pytest.mark.parametrize("options", [
    dict(scheduler="static"),
    dict(max_num_batched_tokens=8, preemption_mode="swap", swap_space_bytes=2**20, num_kv_blocks=12,
         watermark=0.0, speculative=SpeculativeConfig("ngram", 2)),
    dict(enable_prefix_caching=True, speculative=SpeculativeConfig("draft_model", 3, draft_model="tiny")),
])
def test_scheduler_outputs_are_plain_data_and_survive_pickle(tiny64, options):
    """Both ways across the boundary: the runner computes from a pickled copy of
    the SchedulerOutput, and the scheduler applies a pickled copy of the
    RunnerOutput (sampled tokens, the proposer's guesses for the next step)."""
    import pickle
    engine = Engine(tiny64, max_num_seqs=4, max_model_len=48, block_size=4, **options)
    seen, answers, execute = [], [], engine.runner.execute

    def checked(sched):
        assert_plain(sched)
        copy = pickle.loads(pickle.dumps(sched))
        assert copy == sched
        seen.append(sched)
        result = execute(copy)             # the runner computes from the copy: nothing shared
        assert_plain(result, "RunnerOutput")
        back = pickle.loads(pickle.dumps(result))
        assert back == result
        answers.append(back)
        return back
    engine.runner.execute = checked
    n = 2 if options.get("scheduler") != "static" else 1
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [7, 7, 7, 7], [4, 5, 6, 7, 8, 9, 10, 11, 12]]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=14, n=n, ignore_eos=True)) for p in prompts]
    engine.run()
    assert seen and any(s.scheduled and s.scheduled[0].block_table for s in seen)
    if n > 1:                              # forks and proposals crossed the boundary, both ways
        assert any(x.forks for s in seen for x in s.scheduled)
        assert any(x.spec_token_ids for s in seen for x in s.scheduled)
        assert any(a.spec_token_ids for a in answers)
    if "preemption_mode" in options:
        assert any(s.preempted for s in seen)
    if options.get("enable_prefix_caching"):   # a prefix hit sends the tokens before it once
        assert any(x.prefix_token_ids for s in seen for x in s.scheduled)
        assert any(a.draft_shapes for a in answers)
    if n == 1:
        assert any(s.padding for s in seen)
    for r, p in zip(reqs, prompts):
        for sample in engine.samples_of(r.request_id):
            assert sample.output_token_ids == reference_generate(tiny64, p, 14)


# --- found by a second read of the fixes above ------------------------------------------------
def test_a_failing_verification_ends_its_request_not_the_batch(tiny64, monkeypatch):
    """A sampled request failing while its proposals were verified used to end the
    step with a KeyError in the trace record: every request was lost."""
    from minibatch_engine.runner import model_runner
    real = model_runner.sampling_probs

    def probs(logits, params):
        if any(p.top_k == 7 for p in params):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params)
    monkeypatch.setattr(model_runner, "sampling_probs", probs)      # fails inside verification only
    spec = SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=2)
    llm = LLM(tiny64, max_num_seqs=4, speculative=spec)
    bad = SamplingParams(max_tokens=40, temperature=1.0, top_k=7, seed=0, ignore_eos=True)
    good, bad_out = llm.generate([[1, 2, 3], [1, 2, 3]], [SamplingParams(max_tokens=40, ignore_eos=True), bad],
                                 use_tqdm=False)
    assert bad_out.outputs[0].finish_reason == "error" and "verification failed" in llm.engine.requests["1"].error
    assert good.outputs[0].token_ids == reference_generate(tiny64, [1, 2, 3], 40)
    assert sum(s.num_verifications for s in llm.engine.trace.steps) > 0
    assert_all_memory_back(llm.engine)


def test_shutdown_from_another_event_loop_is_refused_and_the_streams_go_on(tiny32):
    """It used to cancel the loop from afar and leave the streams waiting forever."""
    llm = AsyncLLM(tiny32, max_num_seqs=2)
    started, refused = threading.Event(), {}

    async def serve():
        toks = []
        async for o in llm.stream([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)):
            toks.append(o.token_id)
            if len(toks) == 1:
                started.set()
                while "error" not in refused:
                    await asyncio.sleep(0.01)
        await llm.shutdown()
        return toks

    out = {}
    t = threading.Thread(target=lambda: out.update(toks=asyncio.run(serve())))
    t.start()
    assert started.wait(60)

    async def shut():
        try:
            await llm.shutdown()
        except RuntimeError as e:
            refused["error"] = str(e)
    asyncio.run(shut())
    t.join(60)
    assert "another event loop" in refused["error"]
    assert out["toks"] == reference_generate(tiny32, [1, 2, 3], 20)


def test_shutdown_releases_the_step_thread_even_if_the_engine_fails_meanwhile(tiny32, monkeypatch):
    llm = AsyncLLM(tiny32, max_num_seqs=2)
    real = llm.engine.step

    def step():
        if llm._closed:
            raise RuntimeError("the engine broke during shutdown")
        return real()
    monkeypatch.setattr(llm.engine, "step", step)

    async def main():
        stream = llm.stream([1, 2], SamplingParams(max_tokens=50, ignore_eos=True))
        await stream.__anext__()
        await llm.shutdown()                    # used to re-raise and keep the thread
        await stream.aclose()
    asyncio.run(main())
    assert llm._executor._shutdown


def test_text_that_is_not_unicode_is_refused_whatever_the_tokenizer():
    """A Hugging Face tokenizer raised a bare TypeError for a lone surrogate."""
    from minibatch_engine.core.inputs import encode_text

    class Picky:
        def encode(self, text):
            raise TypeError("TextInputSequence must be str")
    with pytest.raises(ValueError, match=r"prompts\[1\].*UTF-8"):
        encode_text(Picky(), "bad \ud800", "prompts[1]")


def test_an_open_loop_client_refuses_arrivals_it_would_wait_years_for(tiny32):
    """sweep --rates 1e-300 on the real model slept forever."""
    from minibatch_engine.entrypoints.async_llm import open_loop
    llm = AsyncLLM(tiny32, max_num_seqs=2)

    async def main():
        try:
            await open_loop(llm, [([1, 2], SamplingParams(max_tokens=1))], arrival_times=[1e300])
        finally:
            await llm.shutdown()
    with pytest.raises(ValueError, match=r"requests\[0\]: arrival time"):
        asyncio.run(main())
