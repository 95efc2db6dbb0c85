"""Where a run's time goes (minibatch_engine.harness.profiling): the split adds up, the
attention timer counts every call (the backend's metadata included) and leaves
the backend as it was, no step pays for a one-time kernel build, and the
engine's fast paths for decode steps keep the KV bookkeeping exact."""
from __future__ import annotations

import math
import time

import pytest

from minibatch_engine import Engine, EngineConfig, SamplingParams
from minibatch_engine.harness.profiling import (PHASES, decode_anatomy, profile_run, step_anatomy, time_shares,
                                       timed_attention)
from minibatch_engine.core.trace import Trace
from minibatch_engine.harness.vs_transformers import format_comparison


def _engine(model, n=6, max_num_seqs=4, **cfg):
    eng = Engine(model, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=64, **cfg))
    for i in range(n):
        eng.add_request(list(range(3, 9 + 3 * i)), SamplingParams(max_tokens=5 + i, ignore_eos=True))
    return eng


def test_the_split_adds_up_and_the_timer_counts_every_layer_call(tiny32):
    eng = _engine(tiny32)
    backend = eng.runner.attention
    with timed_attention(eng) as spent:
        eng.run()
    assert not {"forward", "build_metadata"} & set(vars(backend))   # the backend is as it was
    assert spent["calls"] == tiny32.config.num_layers * len(eng.trace)
    assert sorted(spent["metadata_by_step"]) == list(range(len(eng.trace)))   # one build per step
    shares = time_shares(eng.trace, spent["seconds"], min_running=2,
                         metadata_by_step=spent["metadata_by_step"])
    assert shares.metadata_s == spent["metadata_seconds"] > 0
    assert 0 < shares.attention < 1 and 0 < shares.rest_of_model < 1 and 0 < shares.engine < 1
    assert math.isclose(shares.attention + shares.rest_of_model + shares.engine, 1.0)
    big = [st for st in eng.trace.steps if st.prefill_tokens == 0 and st.num_scheduled >= 2]
    assert shares.big_steps == len(big) > 0 and shares.big_requests == sum(st.num_scheduled for st in big)
    assert 0 < shares.engine_at_large_batch < 1 and shares.engine_us_per_request > 0
    d = shares.as_dict()
    assert d["steps"] == len(eng.trace) and d["attention"] == shares.attention


def test_only_decode_calls_count_when_asked(tiny32):
    eng = _engine(tiny32)
    with timed_attention(eng, only=lambda meta: meta.max_query_len == 1) as spent:
        eng.run()
    decode_steps = sum(st.prefill_tokens == 0 for st in eng.trace.steps)
    assert 0 < decode_steps < len(eng.trace)
    assert spent["calls"] == tiny32.config.num_layers * decode_steps
    decode_context = sum(lane.start + lane.num_tokens for st in eng.trace.steps if st.prefill_tokens == 0
                         for lane in st.lanes)
    assert spent["context_tokens"] == tiny32.config.num_layers * decode_context


def test_timers_nest(tiny32):
    eng = _engine(tiny32)
    with timed_attention(eng) as outer:
        shares = profile_run(eng)
    assert not {"forward", "build_metadata"} & set(vars(eng.runner.attention))
    assert outer["calls"] == tiny32.config.num_layers * shares.num_steps
    assert shares.attention_s >= outer["seconds"] > 0      # the inner timer wraps the outer one
    assert shares.metadata_s >= outer["metadata_seconds"] > 0


def test_the_backends_metadata_is_attention_time_not_the_engines(tiny32, monkeypatch):
    """The reference backend does its padding work (layouts, masks) in build_metadata,
    on the host while the runner prepares the step, outside its forward calls: that
    time is the backend's, so it must land in attention, not in the engine's share."""
    from minibatch_engine.attention.reference import ReferenceBackend
    pause, build = 0.1, ReferenceBackend.build_metadata    # far above a step's own work, even on a busy machine

    def slow_build(self, *args, **kwargs):
        time.sleep(pause)
        return build(self, *args, **kwargs)
    monkeypatch.setattr(ReferenceBackend, "build_metadata", slow_build)
    shares = profile_run(_engine(tiny32, attention_backend="reference"))
    slept = pause * shares.num_steps
    assert shares.metadata_s >= slept
    assert shares.attention * shares.step_s >= slept
    # booked in the engine instead, the sleeps would make its share the larger; a busy machine slows
    # both alike, so this holds however loaded it is (a wall-time bound would not)
    assert shares.engine < shares.attention
    assert math.isclose(shares.attention + shares.rest_of_model + shares.engine, 1.0)


def test_no_step_pays_for_building_the_cpu_kernels(tiny32, monkeypatch):
    """The fused small ops load the C++ kernels at their first call, inside the
    first forward: a first run in a fresh process (a build takes half a minute or
    more) must not book that as model time. profile_run builds them first."""
    from minibatch_engine.attention import cpu_kernel
    built = cpu_kernel.cpu_kernel_or_none()
    if built is None:
        pytest.skip("no C++ kernels here")
    pause, loads = 2.0, []                  # a tiny model's forward (or all of them) takes far less, even on a busy machine

    def slow_load(verbose=False):           # a build, shortened
        loads.append(time.perf_counter())
        time.sleep(pause)
        monkeypatch.setattr(cpu_kernel, "_module", built)
        return built
    monkeypatch.setattr(cpu_kernel, "_module", None)
    monkeypatch.setattr(cpu_kernel, "load_cpu_kernel", slow_load)
    eng = _engine(tiny32, attention_backend="reference")
    shares = profile_run(eng)
    assert len(loads) == 1                                  # built once, before the run
    assert max(st.forward_s for st in eng.trace.steps) < pause
    assert shares.rest_of_model * shares.step_s < pause


def test_no_large_batch_steps_and_bad_inputs(tiny32):
    shares = profile_run(_engine(tiny32, n=2))
    assert shares.big_steps == 0 and math.isnan(shares.engine_at_large_batch)
    with pytest.raises(ValueError, match="no steps"):
        time_shares(Trace())
    with pytest.raises(ValueError, match="no attention backend"):
        with timed_attention(Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b")):
            pass


def test_the_comparison_reports_the_engine_time_shares():
    summary = {"model": "tiny", "workload": "uniform", "num_requests": 2, "output_tokens": 10, "batch": 2,
               "threads": 2, "rounds": 1, "torch": "t", "transformers": "x",
               "systems": {"engine": {"tokens_per_second": 100.0, "requests_token_equal_to_engine": 2}},
               "engine_time_shares": {"attention": 0.21, "attention_metadata": 0.03,
                                      "rest_of_model": 0.71, "engine": 0.08,
                                      "large_batch_min_running": 48, "large_batch_steps": 7,
                                      "engine_at_large_batch": 0.093,
                                      "engine_us_per_request": 6.5}}
    text = format_comparison(summary)
    assert "attention 21% (its metadata 3%)" in text and "engine 9.3% in the 7 decode steps of 48+" in text and "6.5 us" in text


def test_decode_fast_paths_keep_the_bookkeeping_exact(tiny32):
    """A decode that writes into its own last block takes no new block and no copy;
    one into a block shared with a forked sample copies it first (copy-on-write)."""
    eng = Engine(tiny32, EngineConfig(max_num_seqs=4, max_model_len=64, block_size=4))
    alone = eng.add_request(list(range(3, 9)), SamplingParams(max_tokens=6, ignore_eos=True))   # 6 tokens
    forked = eng.add_request(list(range(3, 10)), SamplingParams(max_tokens=6, n=2, temperature=0.9, seed=1,
                                                                 ignore_eos=True))              # 7 tokens
    m = eng.kv_cache.manager
    eng.step()                                   # both prefill; the second forks into two samples
    child = eng.samples_of(forked.request_id)[1]
    shared = m.block_tables[forked.request_id][-1]
    assert m.block_tables[child.request_id][-1] == shared and m.blocks[shared].ref_count == 2
    table_before = list(m.block_tables[alone.request_id])
    eng.step()                                   # decode: position 6 and 7 of 8 in their last blocks
    assert m.block_tables[alone.request_id] == table_before
    assert m.blocks[shared].ref_count == 1 and m.num_cow_copies == 1
    assert m.block_tables[forked.request_id][-1] != m.block_tables[child.request_id][-1]
    m.check_invariants()
    eng.run()
    m.check_invariants()
    assert m.num_used_blocks == 0


def test_a_steps_phases_fit_inside_it_and_the_anatomy_adds_up(tiny32):
    eng = _engine(tiny32)
    eng.run()
    for st in eng.trace.steps:
        phases = (st.schedule_s, st.prepare_s, st.forward_s, st.sample_s, st.update_s)
        assert min(phases) >= 0 and st.forward_s > 0 and st.prepare_s > 0
        assert sum(phases) <= st.wall_dt
    anatomy = step_anatomy(eng.trace)
    steps = eng.trace.steps
    decodes = [k for k, st in enumerate(steps[:-1]) if st.prefill_tokens == 0]
    assert sum(a.num_steps for a in anatomy.values()) == len(decodes) > 0
    for n, a in anatomy.items():
        mine = [k for k in decodes if steps[k].num_scheduled == n]
        start_to_start = sum(steps[k + 1].wall_start - steps[k].wall_start for k in mine) / len(mine)
        assert a.num_running == n and math.isclose(a.step_us, start_to_start * 1e6)
        assert set(a.us) == set(PHASES) and a.us["rest"] > 0
        assert math.isclose(a.host_us + a.us["forward"], a.step_us)
        assert math.isclose(sum(a.share(p) for p in PHASES), 1.0)


def test_decode_anatomy_runs_each_batch_size_and_says_what_is_wrong(tiny32):
    made = []

    def make(b):
        made.append(b)
        return Engine(tiny32, EngineConfig(max_num_seqs=b, max_model_len=64))
    out = decode_anatomy(make, batch_sizes=(1, 3), prompt_len=5, decode_steps=4, rounds=2)
    assert made == [1, 3, 1, 3]                           # alternating rounds
    assert list(out) == [1, 3] and all(a.num_steps == 2 * 4 for a in out.values())
    assert all(a.num_running == b and a.step_us > a.us["forward"] > 0 for b, a in out.items())
    with pytest.raises(ValueError, match="is max_num_seqs below 3"):
        decode_anatomy(lambda b: Engine(tiny32, EngineConfig(max_num_seqs=2, max_model_len=64)),
                       batch_sizes=(3,), decode_steps=4, rounds=1)
    with pytest.raises(ValueError, match="batch_sizes"):
        decode_anatomy(make, batch_sizes=(0,))
    with pytest.raises(ValueError, match="decode_steps"):
        decode_anatomy(make, decode_steps=0)
