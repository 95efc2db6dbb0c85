"""How many CPU threads a forward pass uses: the cores that are actually free.

PyTorch's CPU wheels run their parallel regions on one OpenMP thread per core
(the C++ kernels of :mod:`minibatch_engine.attention.cpu_kernel` use the same
pool, through ``at::parallel_for``). A parallel region ends at a barrier: every
thread waits, spinning, until the last one arrives. On a machine where another
process is busy, the operating system deschedules some of those threads, and
the others spin at the barrier for a time slice or more, once per operator,
hundreds of times per step. Fewer threads than cores, the ones that are free,
avoid the wait.

:func:`free_cores` samples ``/proc/stat`` for a short window (the engine's own
process is idle while it does) and :func:`choose_num_threads` takes that many
threads, never more than PyTorch's default (one per physical core) and never
fewer than one. Where ``/proc/stat`` does not exist (macOS, Windows) the
default stands.
"""
from __future__ import annotations

import os
import time

import torch

# PyTorch's own default, read once before anything here changes it
DEFAULT_NUM_THREADS = torch.get_num_threads()
REUSE_S = 2.0       # engines built within this many seconds reuse one measurement
_last: tuple[float, float | None] | None = None


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs, from the first line of /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)      # idle + iowait
    return sum(fields) - idle, sum(fields)


def free_cores(window_s: float = 0.2) -> float | None:
    """Cores that other processes left idle over ``window_s`` seconds (None where
    the system does not say); this process's own CPU time (threads still
    spinning after its last parallel region) does not count as busy."""
    first, self0 = _cpu_times(), time.process_time()
    if first is None:
        return None
    time.sleep(window_s)
    second, self1 = _cpu_times(), time.process_time()
    busy, total = second[0] - first[0], second[1] - first[1]
    if total <= 0:
        return None
    cpus = os.cpu_count() or 1
    busy -= (self1 - self0) * os.sysconf("SC_CLK_TCK")          # ours, in jiffies
    return cpus * (1 - max(0.0, busy) / total)


def choose_num_threads(free: float | None) -> int:
    """Threads for ``free`` idle cores: the whole free cores (a core more than
    half idle counts), at least one, at most PyTorch's default."""
    if free is None:
        return DEFAULT_NUM_THREADS
    return max(1, min(DEFAULT_NUM_THREADS, int(free + 0.5)))


def set_cpu_threads(setting: int | str = "auto") -> int:
    """Set PyTorch's intra-op threads: ``"auto"`` (the free cores, measured now,
    or within the last ``REUSE_S`` seconds) or a number. Returns the number set."""
    global _last
    if setting == "auto":
        now = time.monotonic()
        if _last is None or now - _last[0] > REUSE_S:
            _last = (now, free_cores(0.1))
        n = choose_num_threads(_last[1])
    else:
        n = int(setting)
    torch.set_num_threads(n)
    return n
