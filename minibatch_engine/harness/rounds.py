"""Timed rounds for side-by-side comparisons: every system runs the same
workload once per round, and who goes first rotates from round to round, so
a slow stretch of a shared machine lands on each system in turn.

Used by ``bench --vs-transformers`` and ``bench --vs-openvino``.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class SystemResult:
    """One system's wall-clock seconds per round and its tokens (from round 1)."""
    name: str
    seconds: list[float] = field(default_factory=list)
    tokens: list[list[int]] | None = None

    def tok_per_s(self, output_tokens: int) -> float:
        """Output tokens per second over the median round."""
        return output_tokens / statistics.median(self.seconds)


def timed_rounds(runs: dict[str, Callable[[], list[list[int]]]], rounds: int, output_tokens: int,
                 log=print, prepare: dict[str, Callable[[], Callable[[], list[list[int]]]]] | None = None,
                 warmup_rounds: int = 0) -> dict[str, SystemResult]:
    """Run each of ``runs`` (name -> a call returning every request's tokens)
    ``rounds`` times, rotating the order each round; log a line per run.
    ``prepare`` (name -> a call returning the run) builds a system's run
    before its timer starts, as a user's server is built before it serves:
    for those names ``runs`` is not used. ``warmup_rounds`` whole rounds go
    first, untimed and not recorded: each system's first-use costs (allocations,
    kernel choices, caches sized on first sight of the workload) land there."""
    prepare = prepare or {}
    names = tuple(runs)
    width = max(map(len, names))
    results = {name: SystemResult(name) for name in names}
    for w in range(warmup_rounds):
        for name in names:
            run = prepare[name]() if name in prepare else runs[name]
            t0 = time.perf_counter()
            with torch.no_grad():
                run()
            log(f"warm-up {w + 1}/{warmup_rounds}  {name:<{width}} {time.perf_counter() - t0:7.2f} s (untimed)")
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            run = prepare[name]() if name in prepare else runs[name]
            t0 = time.perf_counter()
            with torch.no_grad():
                toks = run()
            dt = time.perf_counter() - t0
            results[name].seconds.append(dt)
            results[name].tokens = results[name].tokens or toks
            log(f"round {r + 1}/{rounds}  {name:<{width}} {dt:7.2f} s  {output_tokens / dt:9,.0f} tok/s")
    return results
