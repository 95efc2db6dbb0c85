"""Keep the memory a CPU step frees for the next step.

A prompt step allocates large tensors and frees them a layer later: the tiny
model's ``gate_up`` output for 2,048 tokens is 11 MB, the 125M model's 34 MB.
glibc's ``malloc`` serves a request that large with a fresh ``mmap`` and hands
it back to the kernel at ``free``; smaller freed memory at the top of the heap
is also handed back once it passes a threshold. The next step asks for the
same sizes again, and every new 4 KiB page costs a page fault and a zeroing
by the kernel on first touch. glibc adapts both thresholds to what it sees
freed, but only part way (the mmap threshold stops at 32 MiB). On this book's
machine a 2,048-token prompt step of the tiny model took about 16,000 minor
faults, 2,100 with the thresholds raised (most of those the KV cache's own
first writes), and 8% less time (the CPU appendix, "Pages from the kernel");
a 125M model's prompt step took about 100,000 (400 MB) and 14% longer.

:func:`keep_freed_memory` raises both thresholds with ``mallopt``, once per
process: requests up to :data:`MMAP_THRESHOLD` come from the heap, and freed
memory stays in the process up to :data:`TRIM_THRESHOLD`, so a step reuses the
pages of the step before. The price is memory: the process keeps its peak
step's temporaries instead of returning them between steps (PyTorch's CUDA
caching allocator makes the same trade on a GPU; vLLM's CPU backend asks for
tcmalloc through ``LD_PRELOAD`` for the same reason). Allocations larger than
the threshold, such as the KV pool itself, are still mapped and returned as
before. It changes where memory comes from, never a value computed.

It applies on Linux with glibc only, and not with ``MINIBATCH_SYSTEM_MALLOC=1``
in the environment (or where ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` already tune glibc: the user's settings stand).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 256 << 20   # requests up to this size come from the heap, not a fresh mapping
TRIM_THRESHOLD = 512 << 20   # freed memory kept at the top of the heap before any is returned
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8    # glibc's mallopt parameters (malloc.h)
_kept: bool | None = None    # None: not tried yet in this process


def mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; whether it was set (False off glibc:
    musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        fn = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn(param, int(value)) == 1


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module's text), once per
    process; returns whether they are raised (False: not glibc, or left to the
    environment)."""
    global _kept
    if _kept is None:
        env = os.environ
        _kept = env.get("MINIBATCH_SYSTEM_MALLOC") != "1" and not any(
            k in env for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) and \
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return _kept
