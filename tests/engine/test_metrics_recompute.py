"""recompute_work: what preemption by recompute cost a run, in tokens. The KV it
discards minus what the prefix cache gives back is exactly the work the run
scheduled beyond an undisturbed run's."""
from types import SimpleNamespace

import pytest

from minibatch_engine import SamplingParams
from minibatch_engine.harness.metrics import RecomputeWork, recompute_work

from ..conftest import sim_engine


def fake(prompt, output, discarded=0, hits=0):
    return SimpleNamespace(num_prompt_tokens=prompt, num_output_tokens=output,
                           num_recomputed_tokens=discarded, num_cached_tokens=hits)


def test_the_arithmetic():
    w = recompute_work([fake(10, 5, discarded=12, hits=8), fake(4, 1), fake(3, 0)])
    assert w == RecomputeWork(discarded=12, cache_hits=8, needed=(10 + 5 - 1) + (4 + 1 - 1))
    assert w.recomputed == 4 and w.share == pytest.approx(4 / 18)
    assert recompute_work([]).needed == 0 and recompute_work([]).share != recompute_work([]).share


def tight_run(prefix_caching=True, mode="recompute", blocks=12):
    engine = sim_engine(scheduler="continuous", kv_layout="paged", block_size=4, num_kv_blocks=blocks,
                        watermark=0.0, max_num_seqs=4, max_model_len=64, preemption_mode=mode,
                        enable_prefix_caching=prefix_caching,
                        **({"swap_space_bytes": 10**9} if mode == "swap" else {}))
    lengths = [(9, 20), (13, 15), (6, 25), (11, 18), (7, 22)]
    reqs = [engine.add_request([10 * i + j for j in range(p)], SamplingParams(max_tokens=g, ignore_eos=True))
            for i, (p, g) in enumerate(lengths)]
    engine.run()
    return engine, reqs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_recomputed_is_the_work_beyond_an_undisturbed_run(prefix_caching):
    engine, reqs = tight_run(prefix_caching)
    w = recompute_work(reqs)
    assert w.discarded > 0, "the run must preempt for the test to mean anything"
    assert w.needed == sum(r.num_prompt_tokens + r.num_output_tokens - 1 for r in reqs)
    assert w.needed + w.recomputed == engine.trace.useful_tokens
    if prefix_caching:
        assert 0 < w.cache_hits <= w.discarded and w.recomputed < w.discarded
    else:
        assert w.cache_hits == 0 and w.recomputed == w.discarded


def test_swap_discards_nothing():
    engine, reqs = tight_run(mode="swap")
    w = recompute_work(reqs)
    assert sum(r.num_swaps for r in reqs) > 0
    assert w.discarded == 0 and w.recomputed == 0 and engine.trace.useful_tokens == w.needed
