"""Serving under load: vLLM's benchmark metrics on hand-built traces, arrivals,
and the streaming front end (AsyncLLM)."""
import math

import numpy as np
import pytest

from minibatch_engine.harness.metrics import (parse_goodput, parse_percentiles, request_metrics,
                                      serving_metrics, timings_from_trace)
from minibatch_engine.core.request import Request
from minibatch_engine.sampling.params import SamplingParams
from minibatch_engine.core.trace import StepRecord, Trace
from minibatch_engine.harness.workload import arrival_gaps, make_workload

# Three requests, times in seconds (worked by hand below):
#   a: arrives 0.0, tokens at 1.0 1.5 2.5 3.0 -> TTFT 1.0, E2EL 3.0, TPOT 2/3, ITL 0.5 1.0 0.5
#   b: arrives 1.0, one token at 1.5        -> TTFT 0.5, E2EL 0.5, no TPOT (one token)
#   c: arrives 2.0, tokens at 4.0 6.0       -> TTFT 2.0, E2EL 4.0, TPOT 2.0, ITL 2.0
STEP_ENDS = [1.0, 1.5, 2.5, 3.0, 4.0, 6.0]
REQS = {"a": (0.0, [0, 1, 2, 3]), "b": (1.0, [1]), "c": (2.0, [4, 5])}


def hand_trace():
    trace = Trace()
    for k, end in enumerate(STEP_ENDS):
        start = STEP_ENDS[k - 1] if k else 0.0
        trace.append(StepRecord(step=k, lanes=[], batch_id=None, computed_tokens=1, useful_tokens=1,
                                prefill_tokens=0, decode_tokens=1, num_scheduled=1, sampled_tokens=1,
                                kv_reserved_bytes=0, kv_used_bytes=0, kv_capacity_bytes=0,
                                wall_start=start, wall_end=end, sim_start=start, sim_end=end))
    reqs = []
    for rid, (t0, steps) in REQS.items():
        r = Request(rid, [1, 2], SamplingParams(max_tokens=8))
        r.arrival_time = {"sim": t0, "wall": t0}
        r.arrival_step = next(k for k, e in enumerate(STEP_ENDS) if e > t0)
        for k in steps:
            r.append_token(7, k)
        reqs.append(r)
    return trace, reqs


def test_metric_definitions_on_a_hand_built_trace():
    trace, reqs = hand_trace()
    t = {r.request_id: x for r, x in zip(reqs, timings_from_trace(reqs, trace, "sim"))}
    assert (t["a"].ttft, t["a"].e2el, t["a"].itl) == (1.0, 3.0, [0.5, 1.0, 0.5])
    assert t["a"].tpot == pytest.approx(2 / 3) and t["c"].tpot == 2.0 and t["b"].tpot == 0.0
    m = request_metrics(reqs[0], trace).seconds["sim"]
    assert (m["ttft"], m["e2e"], m["itl"]) == (1.0, 3.0, [0.5, 1.0, 0.5]) and m["tpot"] == pytest.approx(2 / 3)
    assert request_metrics(reqs[0], trace).tpot_steps == 1.0      # (4 - 1) steps / 3 gaps

    s = serving_metrics(list(t.values()), ps=(50, 100), goodput={"ttft": 1000, "tpot": 1000})
    assert s["duration_s"] == 6.0 and s["completed"] == 3                 # first arrival 0 -> last token 6
    assert s["request_throughput"] == 0.5 and s["output_throughput"] == pytest.approx(7 / 6)
    assert s["total_token_throughput"] == pytest.approx((7 + 6) / 6)
    assert (s["ttft_ms_p50"], s["ttft_ms_p100"], s["ttft_ms_mean"]) == pytest.approx((1000, 2000, 3500 / 3))
    # TPOT: one value per request of >= 2 tokens (a, c); b's single token is left out
    assert (s["tpot_ms_p50"], s["tpot_ms_mean"]) == pytest.approx(((2000 / 3 + 2000) / 2,) * 2)
    # ITL: every gap of every request, pooled: 500, 1000, 500, 2000
    assert (s["itl_ms_p50"], s["itl_ms_mean"], s["itl_ms_p100"]) == pytest.approx((750, 1000, 2000))
    assert (s["e2el_ms_p50"], s["e2el_ms_p100"]) == pytest.approx((3000, 4000))
    # goodput: a (TTFT 1000 <= 1000, TPOT 667) and b (TTFT 500, TPOT 0) meet both SLOs; c (TTFT 2000) misses
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(2 / 6)
    assert serving_metrics(list(t.values()), goodput={"e2el": 2999})["good_requests"] == 1   # only b
    assert serving_metrics(list(t.values()), goodput={"tpot": 1999})["good_requests"] == 2   # c's TPOT 2000
    assert "goodput" not in serving_metrics(list(t.values()))


def test_summary_keys_match_the_hand_computation_for_a_real_run():
    from minibatch_engine.harness.bench import run_bench
    s, eng = run_bench(num_requests=30, max_batch=8, seed=2, sim_gpu="H100-SXM", sim_model="llama-3-8b",
                       simulate_only=True, progress=False, arrival_rate=50.0, goodput=["ttft:50"])
    reqs = list(eng.requests.values())
    t = timings_from_trace(reqs, eng.trace, "sim")
    assert s["clock"] == "sim" and s["completed"] == 30
    assert s["ttft_ms_p99"] == pytest.approx(np.percentile([x.ttft * 1e3 for x in t], 99))
    assert s["good_requests"] == sum(x.ttft <= 0.05 for x in t)
    first = min(r.arrival_time["sim"] for r in reqs)
    assert s["duration_s"] == pytest.approx(eng.trace.end_time("sim") - first)


def test_parse_percentiles_and_goodput():
    assert parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    assert parse_goodput(["ttft:200", "e2el:1500"]) == {"ttft": 200.0, "e2el": 1500.0}
    for bad in (["ttfb:2"], ["ttft"], ["ttft:x"], ["tpot:0"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)
    with pytest.raises(ValueError, match="percentiles"):
        parse_percentiles("50,abc")


def test_arrivals_poisson_and_bursty():
    rng = lambda: np.random.default_rng(0)  # noqa: E731
    poisson = arrival_gaps(rng(), 20000, rate=4.0)
    assert poisson.mean() == pytest.approx(0.25, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1, abs=0.03)
    bursty = arrival_gaps(rng(), 20000, rate=4.0, burstiness=0.25)
    # same mean rate, coefficient of variation 1/sqrt(burstiness) = 2
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2, rel=0.05)
    a = make_workload("uniform", 50, seed=3, arrival_rate=2.0, burstiness=0.5)
    b = make_workload("uniform", 50, seed=3, arrival_rate=2.0, burstiness=0.5)
    assert [x.arrival_time for x in a] == [x.arrival_time for x in b]
    assert all(np.diff([x.arrival_time for x in a]) >= 0)
    with pytest.raises(ValueError, match="burstiness"):
        make_workload("uniform", 5, arrival_rate=1.0, burstiness=0)
    with pytest.raises(ValueError, match="arrival_rate"):
        make_workload("uniform", 5, arrival_rate=0.0)
    assert not math.isnan(a[-1].arrival_time)


# --- AsyncLLM -------------------------------------------------------------------------------
import asyncio  # noqa: E402

from minibatch_engine import LLM, AsyncLLM  # noqa: E402

PROMPTS = ["The cat", "Serving under load", "a", "Paged attention and chunked prefill"]
PARAMS = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=9, temperature=0.8, seed=7),
          SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=1), SamplingParams(max_tokens=10)]


def offline(model, **opts):
    outs = LLM(model, **opts).generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


async def consume(llm, prompt, params, rid, record=None):
    toks, text, reason = [], "", None
    async for out in llm.stream(prompt, params, request_id=rid):
        assert reason is None, "nothing after the last output"
        if out.token_id is not None:
            toks.append(out.token_id)
            assert out.index == len(toks)
        text += out.text
        reason = out.finish_reason
        if record is not None:
            record.append(rid)
    return toks, text, reason


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("step_in_thread", [True, False])
def test_streams_yield_exactly_the_offline_tokens(tiny64, step_in_thread):
    ref = offline(tiny64, max_num_seqs=4, max_num_batched_tokens=8)

    async def main():
        async with AsyncLLM(tiny64, max_num_seqs=4, max_num_batched_tokens=8, step_in_thread=step_in_thread) as llm:
            order = []
            got = await asyncio.gather(*(consume(llm, p, sp, f"r{i}", order)
                                         for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))))
            assert len(set(order[:8])) > 1        # tokens of different requests interleave
            return got, llm.engine

    got, engine = run(main())
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in ref]
    assert [x for _, x, _ in got] == [x for _, x, _ in ref]     # text deltas add up to the offline text
    assert engine.kv_cache.num_used_blocks == 0


def test_cancel_while_waiting_in_prefill_chunks_and_decoding_frees_every_block(tiny64):
    long_prompt = list(range(1, 121))            # 120 tokens in chunks of 8: 15 prefill steps
    ref = offline(tiny64, max_num_seqs=3, max_num_batched_tokens=8)

    async def main():
        llm = AsyncLLM(tiny64, max_num_seqs=3, max_num_batched_tokens=8, kv_layout="paged",
                       enable_prefix_caching=False, step_in_thread=True)
        eng = llm.engine
        keep = [asyncio.create_task(consume(llm, p, sp, f"keep{i}")) for i, (p, sp) in enumerate(zip(PROMPTS[:2],
                                                                                                      PARAMS[:2]))]
        decoding = asyncio.create_task(consume(llm, [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True),
                                               "decoding"))
        prefilling = asyncio.create_task(consume(llm, long_prompt, SamplingParams(max_tokens=4), "prefilling"))
        waiting = asyncio.create_task(consume(llm, [9, 9], SamplingParams(max_tokens=200, ignore_eos=True),
                                              "waiting"))

        async def until(cond):
            while not cond():
                await asyncio.sleep(0.0005)

        req = lambda rid: eng.scheduler.requests.get(rid)  # noqa: E731
        await until(lambda: req("prefilling") is not None and req("prefilling").num_computed_tokens >= 16
                    and req("waiting") is not None)
        # Whether "waiting" is still queued now depends on the engine thread's pace (the keeps may have
        # finished): the common case is checked when it happens; both end aborted with nothing held.
        state = {"prefilling": req("prefilling").num_computed_tokens,
                 "queued": req("waiting").first_scheduled_step is None}
        waiting.cancel()
        prefilling.cancel()
        await until(lambda: req("decoding") is not None and req("decoding").num_output_tokens >= 3)
        decoding.cancel()
        got = await asyncio.gather(*keep)
        await llm.wait_idle()
        for t in (prefilling, waiting, decoding):
            with pytest.raises(asyncio.CancelledError):
                await t
        assert eng.kv_cache.num_used_blocks == 0
        eng.kv_cache.manager.check_invariants()
        out = {rid: req(rid) for rid in ("prefilling", "waiting", "decoding")}
        await llm.shutdown()
        return got, out, state

    got, out, state = run(main())
    assert all(r.finish_reason == "abort" for r in out.values())
    assert 16 <= state["prefilling"] and out["prefilling"].num_output_tokens == 0     # ended mid-prefill
    assert out["prefilling"].num_computed_tokens < 120
    if state["queued"]:                          # cancelled before its first step: nothing computed
        assert out["waiting"].first_scheduled_step is None and out["waiting"].num_output_tokens == 0
    assert out["waiting"].num_output_tokens < 200
    assert 3 <= out["decoding"].num_output_tokens < 200
    assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in ref[:2]]      # the others are unaffected


def test_abort_from_outside_ends_the_stream(tiny64):
    async def main():
        async with AsyncLLM(tiny64, max_num_seqs=2) as llm:
            outs = []
            async for out in llm.stream([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True), request_id="x"):
                outs.append(out)
                if len(outs) == 3:
                    await llm.abort("x")
            await llm.wait_idle()
            return outs, llm.engine.kv_cache.num_used_blocks

    outs, used = run(main())
    assert outs[-1].finish_reason == "abort" and outs[-1].token_id is None and used == 0
    assert 3 <= len(outs) - 1 < 500


def test_bad_request_raises_in_the_consumer(tiny64):
    async def main():
        async with AsyncLLM(tiny64, max_model_len=16) as llm:
            with pytest.raises(ValueError, match="max_model_len"):
                async for _ in llm.stream([1] * 10, SamplingParams(max_tokens=10)):
                    pass
            with pytest.raises(ValueError, match="n=2"):
                async for _ in llm.stream([1], SamplingParams(n=2)):
                    pass
    run(main())


def test_200_concurrent_streams_lose_nothing(tiny32):
    specs = make_workload("uniform", 200, seed=5, vocab_size=256, arrival_rate=4000.0)
    for s in specs:
        s.prompt_token_ids, s.max_tokens = s.prompt_token_ids[:12], 1 + s.max_tokens % 4

    async def main():
        from minibatch_engine.entrypoints.async_llm import open_loop
        async with AsyncLLM(tiny32, max_num_seqs=64) as llm:
            recs = await open_loop(llm, specs)
            await llm.wait_idle()
            return recs, llm.engine

    recs, eng = run(main())
    assert len(recs) == 200 and len({r.request_id for r in recs}) == 200
    assert all(r.finish_reason == "length" and len(r.token_ids) == s.max_tokens for r, s in zip(recs, specs))
    assert eng.kv_cache.num_used_blocks == 0
    eng.kv_cache.manager.check_invariants()
    s = serving_metrics([r.timing for r in recs])
    assert s["completed"] == 200 and s["ttft_ms_p50"] > 0 and s["output_throughput"] > 0


def test_bounded_history_forgets_served_requests_and_old_steps(tiny32):
    """A server's setting: with ``history`` the engine forgets each request once
    its stream ends (finished or cancelled) and keeps only the last steps, and
    the streams carry the same tokens as with the whole history kept."""
    specs = make_workload("uniform", 60, seed=6, vocab_size=256, arrival_rate=4000.0)
    for s in specs:
        s.prompt_token_ids, s.max_tokens = s.prompt_token_ids[:12], 1 + s.max_tokens % 6

    async def serve(history):
        from minibatch_engine.entrypoints.async_llm import open_loop
        async with AsyncLLM(tiny32, max_num_seqs=8, history=history) as llm:
            recs = await open_loop(llm, specs)
            cancelled = asyncio.create_task(consume(llm, [3, 4], SamplingParams(max_tokens=400, ignore_eos=True), "c"))
            while "c" not in llm.engine.scheduler.requests:
                await asyncio.sleep(0.0005)
            cancelled.cancel()
            await llm.wait_idle()
            return [r.token_ids for r in recs], llm.engine

    kept, full = run(serve(None))
    bounded, eng = run(serve(8))
    assert bounded == kept
    assert len(full.scheduler.requests) == 61 and full.trace.num_dropped == 0
    assert eng.scheduler.requests == {}                   # served, cancelled: all forgotten
    assert eng.scheduler.policy._seq == {}                # and the policy let go of them too
    # the step count varies (arrivals are on the wall clock), but 60 requests take more than 8 steps, and
    # a trace of history=8 is cut back to its last 8 steps each time it reaches 9 (Trace.append)
    assert eng.trace.num_dropped == eng.scheduler.num_steps - len(eng.trace) > 0 and len(eng.trace) == 8
    assert eng.kv_cache.num_used_blocks == 0
    with pytest.raises(ValueError, match="whole trace"):
        timings_from_trace(list(full.scheduler.requests.values()), eng.trace, "wall")


def test_bounded_history_abort_and_an_id_reused_at_once(tiny32):
    """With ``history``: an abort from outside ends a live stream (once: the
    loop keeps running); a cancelled stream's id can be reused straight away;
    aborting a stream the loop has not taken in yet ends it too."""
    long = SamplingParams(max_tokens=300, ignore_eos=True)

    async def main():
        async with AsyncLLM(tiny32, max_num_seqs=4, history=8) as llm:
            outs = []
            async for out in llm.stream([1, 2, 3], long, request_id="x"):
                outs.append(out)
                if len(outs) == 2:
                    await llm.abort("x")
            first = asyncio.create_task(consume(llm, [4, 5], long, "y"))
            while "y" not in llm.engine.scheduler.requests:
                await asyncio.sleep(0.0005)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first                    # its stream is gone; its request not yet aborted
            again = await consume(llm, [6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "y")
            early = [o async for o in _abort_before_the_loop(llm)]
            await llm.wait_idle()
            return outs, again, early, llm.engine

    outs, again, early, eng = run(main())
    assert outs[-1].finish_reason == "abort" and len(outs) < 300
    assert len(again[0]) == 3 and again[2] == "length"
    assert len(early) == 1 and early[0].finish_reason == "abort" and early[0].token_id is None
    assert eng.scheduler.requests == {} and eng.kv_cache.num_used_blocks == 0


async def _abort_before_the_loop(llm):
    gen = llm.stream([8, 9], SamplingParams(max_tokens=5), request_id="z")
    first = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)                     # the request is in the inbox, not yet in the engine
    await llm.abort("z")
    out = await first
    yield out
    async for out in gen:
        yield out


def test_forget_takes_finished_requests_only():
    from minibatch_engine import Engine, build_model
    eng = Engine(build_model("tiny"), max_num_seqs=2)
    done = eng.add_request([1, 2], SamplingParams(max_tokens=2, n=2, seed=1))
    running = eng.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert done.is_finished and not running.is_finished and done.child_ids
    with pytest.raises(ValueError, match="has not finished"):
        eng.forget(running.request_id)
    with pytest.raises(ValueError, match="forget that one"):
        eng.forget(done.child_ids[0])
    eng.forget(done.request_id)                              # the request and its samples
    assert set(eng.scheduler.requests) == {running.request_id}
    with pytest.raises(KeyError):
        eng.forget(done.request_id)
    eng.add_request([4], SamplingParams(max_tokens=1), request_id=done.request_id)   # the id is free again


def test_trace_max_steps_keeps_the_last_steps():
    from minibatch_engine.core.trace import StepRecord
    trace = Trace(max_steps=16)
    for k in range(100):
        trace.append(StepRecord(step=k, lanes=[], batch_id=None, computed_tokens=1, useful_tokens=1,
                                prefill_tokens=0, decode_tokens=1, num_scheduled=1, sampled_tokens=1,
                                kv_reserved_bytes=0, kv_used_bytes=0, kv_capacity_bytes=0,
                                wall_start=0.0, wall_end=0.0))
    assert 16 <= len(trace) <= 18 and trace[-1].step == 99 and trace[0].step == trace.num_dropped
    with pytest.raises(ValueError, match="max_steps"):
        Trace(max_steps=0)


def test_sweep_command_writes_one_row_per_rate_and_plots(tmp_path):
    from minibatch_engine.entrypoints.cli import main
    from minibatch_engine.harness.sweep import knee, max_rate_under_slo
    rows_path, fig = tmp_path / "s.jsonl", tmp_path / "s.png"
    assert main(["sweep", "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b", "--rates", "2,200",
                 "--num-requests", "60", "--max-batch", "16", "--goodput", "ttft:300", "--jsonl", str(rows_path),
                 "--plot", str(fig), "--no-progress"]) == 0
    rows = [__import__("json").loads(line) for line in rows_path.read_text().splitlines()]
    assert [r["rate"] for r in rows] == [2.0, 200.0] and all(r["completed"] == 60 for r in rows)
    assert rows[1]["ttft_ms_p99"] > 2 * rows[0]["ttft_ms_p99"]       # overloaded: the queue grows
    assert knee(rows) == 200.0 and max_rate_under_slo(rows, {"ttft": 300}) == 2.0
    assert fig.stat().st_size > 1000
    assert main(["sweep", "--sim-gpu", "H100-SXM", "--rates", "1", "--no-progress"]) == 2    # no --sim-model
    assert main(["sweep", "--sim-gpu", "H100-SXM", "--sim-model", "llama-3-8b", "--rates", "0,1",
                 "--no-progress"]) == 2
