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

Load also arrives after the engine starts. :class:`LoadFollower` re-decides
during the run: between steps it looks at the clock, and at most every
``FOLLOW_INTERVAL_S`` it reads ``/proc/stat`` again (no sleep: the window is
the time since its last look, the engine's own CPU time taken out) and sets
the threads the machine's idle CPUs allow, at most the ceiling the engine was
given. It gives threads up at once (a collapse is costly) and takes them back
only when two looks in a row agree (so a load near a threshold does not flip
the count every look). On a quiet machine it changes nothing. The cost is one
file read at most four times a second; it reacts within about half a second, during
which a collapse can last. The counts are the whole machine's: CPU affinity
and cgroup limits are not read.

The tokens do not depend on the thread count. The engine's own kernels split
their work by rows or output columns, never along a sum; the linear layers are
oneDNN's and MKL's, whose results at one and two threads were checked equal
bit for bit on this book's shapes; and a test checks that a run whose threads
drop mid-way gives a one-thread run's greedy tokens.
"""
from __future__ import annotations

import os
import time

import torch

# PyTorch's own default, read once before anything here changes it
DEFAULT_NUM_THREADS = torch.get_num_threads()
REUSE_S = 2.0       # engines built within this many seconds reuse one measurement
FOLLOW_INTERVAL_S = 0.25  # how often a running engine looks at the load again
QUIET_BUSY_CORES = 0.5    # other processes using less than this: a quiet machine
_last: tuple[float, float | None] | None = None


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs, from the first line of /proc/stat."""
    try:
        with open("/proc/stat") as f:
            # user nice system idle iowait irq softirq steal (guest time is inside user and nice)
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)      # idle + iowait
    return sum(fields) - idle, sum(fields)


def _sample() -> tuple[tuple[int, int] | None, float]:
    """The CPUs' jiffies and this process's own CPU seconds, now."""
    return _cpu_times(), time.process_time()


def _free_between(first, second) -> float | None:
    """Cores that other processes left idle between two :func:`_sample` s; this
    process's own CPU time (threads still spinning after its last parallel
    region included) does not count as busy."""
    (c0, self0), (c1, self1) = first, second
    if c0 is None or c1 is None:
        return None
    busy, total = c1[0] - c0[0], c1[1] - c0[1]
    if total <= 0:
        return None
    cpus = os.cpu_count() or 1
    busy -= (self1 - self0) * os.sysconf("SC_CLK_TCK")          # ours, in jiffies
    return cpus * (1 - max(0.0, busy) / total)


def free_cores(window_s: float = 0.2) -> float | None:
    """Cores that other processes left idle over ``window_s`` seconds (None where
    the system does not say)."""
    first = _sample()
    if first[0] is None:
        return None
    time.sleep(window_s)
    return _free_between(first, _sample())


def choose_num_threads(free: float | None, ceiling: int = DEFAULT_NUM_THREADS) -> int:
    """Threads for ``free`` idle cores: the whole free cores (a core at least
    half idle counts), at least one, at most ``ceiling`` (PyTorch's default
    unless the engine was given a number). On a quiet machine (other processes
    busy for less than half a core) the ceiling itself."""
    if free is None or (os.cpu_count() or 1) - free < QUIET_BUSY_CORES:
        return ceiling
    return max(1, min(ceiling, int(free + 0.5)))


def measured_free_cores() -> float | None:
    """:func:`free_cores` over a tenth of a second, or the measurement of the last
    ``REUSE_S`` seconds (engines built together measure once)."""
    global _last
    now = time.monotonic()
    if _last is None or now - _last[0] > REUSE_S:
        _last = (now, free_cores(0.1))
    return _last[1]


def thread_ceiling(setting: int | str) -> int:
    """The most threads a ``cpu_threads`` setting allows: PyTorch's default for
    ``"auto"``, else the number given."""
    return DEFAULT_NUM_THREADS if setting == "auto" else int(setting)


def set_cpu_threads(setting: int | str = "auto", follow_load: bool = True) -> int:
    """Set PyTorch's intra-op threads and return the number set: ``"auto"``, the
    free cores (at most PyTorch's default); a number N, that many, or the free
    cores if fewer (``follow_load=False``: exactly N)."""
    if setting != "auto" and not follow_load:
        n = int(setting)
    else:
        n = choose_num_threads(measured_free_cores(), thread_ceiling(setting))
    torch.set_num_threads(n)
    return n


class LoadFollower:
    """Re-decides the threads while the engine runs, from the load other
    processes put on the CPUs since the last look (see the module's text).

    ``poll()`` is called once per step; it returns the threads now set."""

    def __init__(self, ceiling: int, interval_s: float = FOLLOW_INTERVAL_S):
        self.ceiling, self.interval_s = ceiling, interval_s
        self.changes = 0                      # how many times it changed the threads
        self._t, self._mark = time.monotonic(), _sample()
        self._wants_more = False              # the last look asked for more threads than set

    def poll(self) -> int:
        now = time.monotonic()
        current = torch.get_num_threads()
        if now - self._t < self.interval_s:
            return current
        mark = _sample()
        free = _free_between(self._mark, mark)
        self._t, self._mark = now, mark
        n = choose_num_threads(free, self.ceiling)
        if n > current and not self._wants_more:   # more: only when two looks in a row agree
            self._wants_more = True
            return current
        self._wants_more = False
        if n != current:
            torch.set_num_threads(n)
            self.changes += 1
        return n
