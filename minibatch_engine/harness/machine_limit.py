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

A rate measured while other work shares the CPU is too low, and a limit the
engine then beats is no limit. So each rate is the best of :data:`ROUNDS`
rounds, stored with the time and the load average it was measured at; a cached
limit older than the CPU's last change (the last boot, or a change of its
frequency policy) is measured afresh; and a run that beats its limit has it
measured again at once, keeping the best rates this CPU has shown. A run that
beats even the fresh measurement shows the CPU can go at least as fast as the
run did: its limit is then taken as the run's own rate (both rates scaled up
until its larger share is exactly 100%), and the report says so. No share is
ever above 100%, and the report says where its limit came from.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..sim.hardware import GPU
from ..sim.operators import PROJECTIONS, projection_shape
from ..sim.roofline import RooflineCostModel

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minibatch_engine" / "machine_limit.json"
ROWS = 256                 # rows of the calibration GEMMs: enough to be compute-bound on a CPU
LARGE_BATCH = 32           # steps with at least this many token rows count as large-batch


ROUNDS = 3                 # calibration rounds; each rate is the best of them


@dataclass(frozen=True)
class Rates:
    """This CPU's measured rates, and where they came from."""
    flops_per_s: float     # the model's GEMMs, at ROWS rows
    bytes_per_s: float     # a large copy (read + write)
    measured_at: float | None = None      # Unix time of the (last) calibration
    load_average: float | None = None     # the 1-minute load average then
    rounds: int = 1                       # calibration rounds behind the rates
    remeasured: bool = False              # measured again because a run beat the cached limit
    raised_to_run: bool = False           # raised to the rate of a run that beat even the re-measurement

    def provenance(self) -> str:
        """One line: how and when the rates were measured."""
        when = (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.measured_at))
                if self.measured_at else "at an unknown time")
        load = f", load average {self.load_average:.1f}" if self.load_average is not None else ""
        again = "; re-measured for this run, which beat the cached limit" if self.remeasured else ""
        beat = ("; this run beat the measured limit; the limit is taken as at least this run's rate"
                if self.raised_to_run else "")
        return f"best of {self.rounds} rounds, {when}{load}{again}{beat}"


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


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def calibrate(model: ModelConfig, dtype: torch.dtype = torch.float32, rounds: int = ROUNDS) -> Rates:
    """Measure this machine's rates for ``model`` (a second or so a round, uncached):
    each rate the best of ``rounds`` rounds, a short pause between them (another
    process's burst of work then spoils one round, not all)."""
    weights = [torch.randn(n_in, n_out, dtype=dtype) for n_in, n_out in _shapes(model)]
    x = {n: torch.randn(ROWS, n, dtype=dtype) for n, _ in _shapes(model)}
    flops = sum(2 * ROWS * w.shape[0] * w.shape[1] for w in weights)
    src = torch.empty(64 * 2**20, dtype=torch.float32)       # 256 MiB: far past the caches
    dst = torch.empty_like(src)
    seconds = copy_s = float("inf")
    for r in range(rounds):
        if r:
            time.sleep(0.2)
        seconds = min(seconds, _best(lambda: [x[w.shape[0]] @ w for w in weights], reps=5))
        copy_s = min(copy_s, _best(lambda: dst.copy_(src), reps=3))
    return Rates(flops / seconds, 2 * src.numel() * src.element_size() / copy_s,
                 measured_at=time.time(), load_average=_load_average(), rounds=rounds)


def cpu_changed_at() -> float:
    """When this CPU last changed, as far as the OS tells: the last boot, or a
    later change of a frequency policy (its cpufreq files' times). 0 if unknown."""
    times = []
    try:
        times += [float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime")]
    except (OSError, ValueError, IndexError):
        pass
    for f in Path("/sys/devices/system/cpu/cpufreq").glob("policy*/scaling_[gm]*"):
        try:
            times.append(f.stat().st_mtime)
        except OSError:
            pass
    return max(times, default=0.0)


def _key(model: ModelConfig, dtype: torch.dtype) -> str:
    try:
        cpu = next((line for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    parts = [platform.machine(), cpu, torch.__version__, str(dtype), str(torch.get_num_threads()),
             repr(_shapes(model))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def machine_rates(model: ModelConfig, dtype: torch.dtype = torch.float32, remeasure: bool = False) -> Rates:
    """This machine's rates for ``model``: from the cache, or calibrated and cached.

    The cache is measured afresh when it predates :func:`cpu_changed_at` (or
    holds no date). ``remeasure``: a run beat the cached limit, so calibrate
    again now and keep, rate by rate, the better of the two (a rate measured on
    a busy machine is only ever too low)."""
    key = _key(model, dtype)
    try:
        cached = json.loads(CACHE.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(key) if isinstance(cached, dict) else None
    try:
        old = Rates(**entry) if entry else None
    except TypeError:
        old = None
    fresh = old is not None and old.measured_at is not None and old.measured_at >= cpu_changed_at()
    if fresh and not remeasure:
        return old
    rates = calibrate(model, dtype)
    if fresh and remeasure:
        rates = Rates(max(rates.flops_per_s, old.flops_per_s), max(rates.bytes_per_s, old.bytes_per_s),
                      rates.measured_at, rates.load_average, rates.rounds + old.rounds)
    rates = replace(rates, remeasured=remeasure)
    cached = cached if isinstance(cached, dict) else {}
    cached[key] = {k: v for k, v in rates.__dict__.items() if k not in ("remeasured", "raised_to_run")}
    try:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps(cached, indent=1))
    except OSError:
        pass                      # a read-only home: measure again next time
    return rates


def _beaten_by(lim: dict) -> float:
    """The larger of a run's two shares (NaN, no large-batch steps, ignored)."""
    return max((f for f in (lim["limit_fraction"], lim["large_batch_limit_fraction"]) if f == f), default=0.0)


def run_against_limit(trace, model: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """:func:`limit_of_run` at this machine's rates, never above a share of 1.
    If the run beats them, the rates are measured again first (see
    :func:`machine_rates`); if it beats those too, both rates are scaled up to
    the run's own (its larger share becomes exactly 1, ``limit_raised_to_run``)."""
    rates = machine_rates(model, dtype)
    lim = limit_of_run(trace, model, rates, dtype)
    if _beaten_by(lim) > 1:
        rates = machine_rates(model, dtype, remeasure=True)
        lim = limit_of_run(trace, model, rates, dtype)
    beat = _beaten_by(lim)
    if beat > 1:                  # a roofline step scales as 1/rate when both rates scale together
        rates = replace(rates, flops_per_s=rates.flops_per_s * beat, bytes_per_s=rates.bytes_per_s * beat,
                        raised_to_run=True)
        lim = limit_of_run(trace, model, rates, dtype)
        for k in ("limit_fraction", "large_batch_limit_fraction"):
            lim[k] = min(lim[k], 1.0)           # (rounding only; NaN stays NaN)
    return lim


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
            "limit_measured_at": rates.measured_at, "limit_load_average": rates.load_average,
            "limit_rounds": rates.rounds, "limit_remeasured": rates.remeasured,
            "limit_raised_to_run": rates.raised_to_run,
            "limit_provenance": rates.provenance(),
            "limit_seconds": limit,
            "limit_fraction": limit / wall if wall > 0 else float("nan"),
            "large_batch_limit_fraction": limit_large / wall_large if wall_large > 0 else float("nan")}
