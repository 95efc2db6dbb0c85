"""How far a CPU run is from what this CPU can do for its model: the machine's limit.

A short calibration measures two rates of this machine, on the run's threads:
the float rate of the model's own matrix products (its projections' shapes at
256 rows, best of a few repetitions) and the memory bandwidth (a copy far larger
than the caches). A run's limit is then the time its steps would take at those
rates, each step the larger of its FLOPs and its bytes (every weight read once,
each sequence's K/V read, the new K/V written): the ideal roofline of
:class:`~minibatch_engine.sim.roofline.RooflineCostModel`, with this CPU's
measured rates in place of a GPU's datasheet. ``bench`` reports the run's time
against it, overall and for its large-batch steps. The rates are cached per CPU,
torch version, dtype, thread count and shapes (``~/.cache/minibatch_engine``).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .model.config import ModelConfig
from .sim.hardware import GPU
from .sim.operators import PROJECTIONS, projection_shape
from .sim.roofline import RooflineCostModel

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minibatch_engine" / "machine_limit.json"
ROWS = 256                 # rows of the calibration GEMMs: enough to be compute-bound on a CPU
LARGE_BATCH = 32           # steps with at least this many token rows count as large-batch


@dataclass(frozen=True)
class Rates:
    flops_per_s: float     # the model's GEMMs, at ROWS rows
    bytes_per_s: float     # a large copy (read + write)


def _shapes(model: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one layer's projections (the simulator's, unsharded)."""
    return [projection_shape(op, model) for op in PROJECTIONS]


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(model: ModelConfig, dtype: torch.dtype = torch.float32) -> Rates:
    """Measure this machine's rates for ``model`` (about a second, uncached)."""
    weights = [torch.randn(n_in, n_out, dtype=dtype) for n_in, n_out in _shapes(model)]
    x = {n: torch.randn(ROWS, n, dtype=dtype) for n, _ in _shapes(model)}
    flops = sum(2 * ROWS * w.shape[0] * w.shape[1] for w in weights)
    seconds = _best(lambda: [x[w.shape[0]] @ w for w in weights], reps=5)
    src = torch.empty(64 * 2**20, dtype=torch.float32)       # 256 MiB: far past the caches
    dst = torch.empty_like(src)
    copy_s = _best(lambda: dst.copy_(src), reps=3)
    return Rates(flops / seconds, 2 * src.numel() * src.element_size() / copy_s)


def _key(model: ModelConfig, dtype: torch.dtype) -> str:
    try:
        cpu = next((line for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    parts = [platform.machine(), cpu, torch.__version__, str(dtype), str(torch.get_num_threads()),
             repr(_shapes(model))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def machine_rates(model: ModelConfig, dtype: torch.dtype = torch.float32) -> Rates:
    """This machine's rates for ``model``: from the cache, or calibrated once and cached."""
    key = _key(model, dtype)
    try:
        cached = json.loads(CACHE.read_text())
    except (OSError, ValueError):
        cached = {}
    if key in cached:
        return Rates(**cached[key])
    rates = calibrate(model, dtype)
    cached[key] = {"flops_per_s": rates.flops_per_s, "bytes_per_s": rates.bytes_per_s}
    try:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass                      # a read-only home: measure again next time
    return rates


def limit_of_run(trace, model: ModelConfig, rates: Rates, dtype: torch.dtype = torch.float32) -> dict:
    """The run's steps against this machine's limit: ``limit_fraction`` (the time
    the steps would take at the machine's rates, over the wall time they took),
    and the same for the steps of at least ``LARGE_BATCH`` token rows."""
    size = torch.empty(0, dtype=dtype).element_size()
    cpu = GPU("this CPU", rates.flops_per_s, rates.bytes_per_s, 0.0, 1.0, 1.0, "measured by machine_limit.calibrate")
    roof = RooflineCostModel(cpu, model, bytes_per_param=size, kv_bytes_per_element=size, step_overhead_s=0.0)
    limit = wall = limit_large = wall_large = 0.0
    for st in trace.steps:
        shapes = [(lane.num_tokens, lane.start + lane.num_tokens) for lane in st.lanes]
        if not shapes:
            continue
        t = roof.step_cost(shapes).seconds
        limit += t
        wall += st.wall_dt
        if st.computed_tokens >= LARGE_BATCH:
            limit_large += t
            wall_large += st.wall_dt
    return {"matmul_flops_per_s": rates.flops_per_s, "memory_bytes_per_s": rates.bytes_per_s,
            "limit_seconds": limit,
            "limit_fraction": limit / wall if wall > 0 else float("nan"),
            "large_batch_limit_fraction": limit_large / wall_large if wall_large > 0 else float("nan")}
