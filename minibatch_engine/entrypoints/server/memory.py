"""Keep a long-running server's memory from creeping: glibc's malloc arenas.

glibc gives each thread that allocates its own malloc arena, up to eight per
core, and frees memory back to the arena that handed it out. A server whose
engine loop runs in one thread while the HTTP handlers (and torch's worker
threads) allocate and free in others ends up with many arenas, each holding
freed pieces of tensors and buffers of every size; the resident size then
creeps up with the number of requests served. Measured on this book's
two-core machine, `serve --model tiny-py` over 4,000 streams (40% of them
cut off early): 426 MB at start, 910 MB at the end and still rising slowly
with glibc's default; 586 MB, flat from about 1,500 streams on, with at most
two arenas (see ``book/how_to_run.md``).

:func:`limit_malloc_arenas` sets that limit (``mallopt(M_ARENA_MAX, n)``)
before the server starts its threads, as setting ``MALLOC_ARENA_MAX=2`` in
the environment would. It does nothing off glibc, or when the environment
already sets ``MALLOC_ARENA_MAX`` (the operator's choice wins).
"""
from __future__ import annotations

import os

from ...runner.cpu_memory import M_ARENA_MAX, mallopt

DEFAULT_ARENAS = 2


def limit_malloc_arenas(n: int = DEFAULT_ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``n`` for this process; whether the cap was set."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return mallopt(M_ARENA_MAX, n)
