"""What a quantized KV cache buys under load, on this CPU (chapter 13).

:func:`kv_dtypes_under_load` runs one workload, all requests at time 0, at one
fixed KV byte budget, once per ``kv_cache_dtype``, and puts side by side what
the cache's bytes decide (blocks, peak concurrency, preemptions, steps: these
depend only on the schedule, so they are the same on every machine) and what
the clock measures (throughput, p99 TPOT: wall-clock, for display).
"""
from __future__ import annotations

from ..harness.bench import run_bench

DETERMINISTIC = ("kv_cache_dtype", "kv_bytes_per_token", "kv_blocks", "peak_running", "preemptions",
                 "recomputed_tokens", "steps", "output_tokens")
WALL_CLOCK = ("output_tokens_per_second", "tpot_ms_p99")


def kv_dtypes_under_load(kv_budget_bytes: int, dtypes=("auto", "fp8", "int8"), model="tiny-py",
                         dtype: str = "bfloat16", workload: str = "uniform", num_requests: int = 32,
                         max_batch: int = 32, seed: int = 0, progress: bool = False,
                         **engine_options) -> list[dict]:
    """One row per KV dtype: the keys of :data:`DETERMINISTIC` then :data:`WALL_CLOCK`.
    ``engine_options`` are further :class:`~minibatch_engine.config.EngineConfig`
    fields (``attention_backend``, ``block_size``, ``preemption_mode``, ...)."""
    rows = []
    for kv in dtypes:
        s, _ = run_bench(workload=workload, num_requests=num_requests, max_batch=max_batch, seed=seed,
                              model=model, device="cpu", dtype=dtype, progress=progress,
                              kv_budget_bytes=kv_budget_bytes, kv_cache_dtype=kv, **engine_options)
        rows.append({k: s[k] for k in DETERMINISTIC + WALL_CLOCK})
    return rows
