"""A prompt's attention two ways through the C++ kernel (the CPU appendix):
as one prompt, whose queries the kernel walks in blocks along a vector's lanes
(``csrc/query_block.h``), and as the same queries handed over as one-token
rows, each walking its keys alone (the per-token loop decode steps use).

The two calls do the same work: every query attends to the same keys, read
from the same pool through the same block table, and the outputs agree to
float32 rounding. :func:`prompt_paths` times them in alternating rounds.
Wall clock on a shared machine: medians, and the ratio within each round.
"""
from __future__ import annotations

import statistics
import time

import torch


def prompt_case(config, length: int, block_size: int = 16, seed: int = 0) -> dict:
    """One layer's prompt of ``length`` tokens with the model's head counts, its
    blocks shuffled over a pool: the kernel's arguments as one prompt
    (``"prompt"``) and as ``length`` one-token rows (``"rows"``)."""
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    blocks = -(-length // block_size)
    table = torch.randperm(blocks + 4, generator=g)[:blocks]
    pos = torch.arange(length)
    slots = table[pos // block_size] * block_size + pos % block_size
    q, k, v = (torch.randn(length, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    pools = [torch.zeros((blocks + 4) * block_size, Hkv, D) for _ in "kv"]
    prompt = (q, k, v, *pools, slots, table.view(1, -1), torch.tensor([length]), torch.tensor([0, length]),
              block_size, True)
    rows = (q, k, v, *pools, slots, table.view(1, -1).expand(length, -1).contiguous(), pos + 1,
            torch.arange(length + 1), block_size, True)
    return {"prompt": prompt, "rows": rows, "pairs": length * (length + 1) // 2 * Hq}


def prompt_paths(config, length: int = 1024, rounds: int = 6, threads: int = 1) -> dict:
    """Nanoseconds per (query, key, head) for a ``length``-token prompt's attention
    as one prompt and as one-token rows (medians of ``rounds`` alternating
    rounds, on ``threads`` threads), the per-round time ratio rows / prompt, and
    the largest difference between the two outputs."""
    from ..attention.cpu_kernel import load_cpu_kernel
    kernel = load_cpu_kernel()
    case = prompt_case(config, length)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs = {way: kernel.paged_attention(*case[way]) for way in ("prompt", "rows")}
        seconds = {way: [] for way in outs}
        for r in range(rounds):
            for way in ("prompt", "rows")[:: 1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                kernel.paged_attention(*case[way])
                seconds[way].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    ns = {way: statistics.median(t) / case["pairs"] * 1e9 for way, t in seconds.items()}
    ratios = [r / p for r, p in zip(seconds["rows"], seconds["prompt"])]
    return {"length": length, "ns_prompt": ns["prompt"], "ns_rows": ns["rows"],
            "ratio": statistics.median(ratios), "ratios": ratios,
            "max_abs_diff": float((outs["prompt"] - outs["rows"]).abs().max())}
