"""A long run's memory levels off (issue 38, item 11). A bounded soak: an
``AsyncLLM`` with bounded history (as a server runs) serves waves of sampled
streams; after each wave, free heap memory is handed back to the OS
(``malloc_trim``) so that the resident size counts what is live or
fragmented, not what glibc keeps for reuse. After the warm-up (the trace
filling its ``history``, allocator pools, the prefix cache), neither the
resident size nor the count of Python objects may keep growing. The test is
bounded by wall time (it stops early on a slow machine) and asserts only on
the waves it completed, so it cannot depend on the machine's speed."""
import asyncio
import ctypes
import ctypes.util
import gc
import os
import time

import pytest

from minibatch_engine import AsyncLLM, SamplingParams

WAVES, PER_WAVE, BUDGET_S = 24, 16, 45.0


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow                       # make test-slow: up to BUDGET_S of waves
@pytest.mark.skipif(not os.path.exists("/proc/self/statm") or not ctypes.util.find_library("c"),
                    reason="needs Linux's /proc and glibc")
def test_a_long_run_levels_off(tiny32):
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    llm = AsyncLLM(tiny32, max_num_seqs=16, max_model_len=128, kv_budget_bytes=2 * 2**20, history=64,
                   attention_backend="sdpa")

    async def one(i):
        params = SamplingParams(max_tokens=4 + i % 8, temperature=0.8, top_k=20, seed=i, ignore_eos=True)
        return [o async for o in llm.stream(list(range(1, 12 + i % 30)), params)]

    async def main():
        await asyncio.gather(*(one(j) for j in range(PER_WAVE)))     # untimed: a first run may build kernels
        samples, t0 = [], time.monotonic()
        for w in range(1, WAVES + 1):
            await asyncio.gather(*(one(w * PER_WAVE + j) for j in range(PER_WAVE)))
            gc.collect()
            libc.malloc_trim(0)
            samples.append((rss_mib(), len(gc.get_objects())))
            if time.monotonic() - t0 > BUDGET_S:
                break
        await llm.shutdown()
        return samples
    samples = asyncio.run(main())
    if len(samples) < 9:
        pytest.skip(f"only {len(samples)} waves in {BUDGET_S:.0f} s: too few to see a trend")
    third = len(samples) // 3
    warm, end = samples[third], samples[-1]
    waves = len(samples) - 1 - third
    # after the warm-up: at most 0.5 MiB and 0.5% more Python objects a wave, on average
    assert end[0] - warm[0] <= 0.5 * waves + 8, f"resident MiB by wave: {[round(s[0]) for s in samples]}"
    assert end[1] - warm[1] <= 0.005 * warm[1] * waves / 8 + 500, f"objects: {[s[1] for s in samples]}"
    assert not llm.engine.scheduler.requests and len(llm.engine.trace) <= 2 * 64
