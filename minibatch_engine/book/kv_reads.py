"""How fast the C++ paged-attention kernel reads K and V on this CPU (chapter 10
and its appendix on the CPU kernels).

* :func:`layout_rates`: the kernel on a synthetic decode step whose sequences'
  blocks lie consecutive in the pool or shuffled, a layer at a time, as a step
  reads them;
* :func:`decode_read_rate`: the kernel inside a workload's decode steps
  (context bytes over the time inside its attention calls);
* :func:`stream_rate`: a plain ``sum`` over a large tensor, the simplest stream
  of reads there is, to compare with.

Wall clock on a shared machine: each takes a median over rounds (the layouts
in alternating rounds), and the rates are bytes per second.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..harness.profiling import timed_attention


def kv_bytes_per_token(config, dtype_bytes: int = 4) -> int:
    """One layer's K and V for one token (float32 by default)."""
    return 2 * config.num_kv_heads * config.head_dim * dtype_bytes


@dataclass
class SyntheticStep:
    """A decode step's inputs for the cpp backend, and one pool pair per layer."""
    backend: object
    inputs: tuple          # q, k, v, meta
    pools: list            # [(k_pool, v_pool)] per layer
    bytes_per_layer: int   # the context K and V one layer's call reads


def synthetic_decode_step(config, scattered: bool, seqs: int = 64, context: int = 384,
                          layers: int = 4, block_size: int = 16, seed: int = 0) -> SyntheticStep:
    """``seqs`` sequences of ``context`` tokens decoding one token each, their
    blocks consecutive in the pool or (``scattered``) shuffled over it."""
    from ..attention import get_attention_backend
    g = torch.Generator().manual_seed(seed)
    num_blocks = seqs * context // block_size
    order = torch.randperm(num_blocks, generator=g) if scattered else torch.arange(num_blocks)
    cpp = get_attention_backend("cpp", "cpu")
    meta = cpp.build_metadata([1] * seqs, [context] * seqs, order.view(seqs, -1).tolist(), block_size)
    shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
    pools = [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(layers)]
    q = torch.randn(seqs, config.num_heads, config.head_dim, generator=g)
    k, v = (torch.randn(seqs, config.num_kv_heads, config.head_dim, generator=g) for _ in "kv")
    return SyntheticStep(cpp, (q, k, v, meta), pools, seqs * context * kv_bytes_per_token(config))


def layer_seconds(step: SyntheticStep) -> float:
    """Seconds per layer for one pass over the step's layers (one call each)."""
    q, k, v, meta = step.inputs
    t0 = time.perf_counter()
    for k_pool, v_pool in step.pools:
        step.backend.forward(q, k, v, meta, k_pool, v_pool)
    return (time.perf_counter() - t0) / len(step.pools)


def layout_rates(config, rounds: int = 6, **step_args) -> dict:
    """Bytes per second of the kernel on the synthetic step, blocks consecutive
    and shuffled: the median of ``rounds`` alternating rounds, each layout first
    in turn. Also gives the pools' size (``"pool_mib"``) and layer count."""
    steps = {"consecutive": synthetic_decode_step(config, False, **step_args),
             "shuffled": synthetic_decode_step(config, True, **step_args)}
    seconds = {name: [] for name in steps}
    for r in range(rounds):
        for name in list(steps)[:: 1 if r % 2 == 0 else -1]:
            seconds[name].append(layer_seconds(steps[name]))
    some = steps["consecutive"]
    out = {name: steps[name].bytes_per_layer / statistics.median(t) for name, t in seconds.items()}
    out["pool_mib"] = some.bytes_per_layer * len(some.pools) / 2**20
    out["layers"] = len(some.pools)
    return out


def loop_rates(config, rounds: int = 6, **step_args) -> dict:
    """Bytes per second of the kernel's explicit-SIMD passes and of its plain
    loops, on the synthetic step with consecutive blocks: the median of
    ``rounds`` alternating rounds, each version first in turn."""
    step = synthetic_decode_step(config, False, **step_args)
    seconds = {True: [], False: []}
    for r in range(rounds):
        for simd in (True, False)[:: 1 if r % 2 == 0 else -1]:
            step.backend.simd = simd
            seconds[simd].append(layer_seconds(step))
    step.backend.simd = True
    return {"simd": step.bytes_per_layer / statistics.median(seconds[True]),
            "plain": step.bytes_per_layer / statistics.median(seconds[False])}


def decode_read_rate(engine) -> float:
    """Context bytes per second that ``engine``'s attention backend reads in the
    decode steps of a run to the end (the engine holds its requests already)."""
    per_token = kv_bytes_per_token(engine.runner.model.config)
    with timed_attention(engine, only=lambda meta: meta.max_query_len == 1) as spent:
        engine.run()
    return spent["context_tokens"] * per_token / spent["seconds"]


def stream_rate(mib: int = 256, reps: int = 5) -> float:
    """Bytes per second of ``sum`` over ``mib`` MiB of float32: the median of ``reps``."""
    big = torch.ones(mib * 2**20 // 4)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t0)
    return big.numel() * 4 / statistics.median(times)


def last_level_cache_bytes() -> int:
    """The largest CPU cache the OS reports (Linux sysfs); 0 where unknown."""
    units, sizes = {"K": 2**10, "M": 2**20, "G": 2**30}, []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = units.get(size[-1], 1)
        sizes.append(int(size[:-1] if scale > 1 else size) * scale)
    return max(sizes, default=0)
