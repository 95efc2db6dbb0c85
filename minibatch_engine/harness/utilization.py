"""Model FLOPs and bandwidth utilisation (MFU, MBU) of a simulated run.

MFU (PaLM, Chowdhery et al. 2022) is the FLOPs the model needs for the tokens
it computed, over what the GPUs could do at their peak in the same time:

    MFU = model FLOPs / (seconds x GPUs x peak FLOP/s)

MBU (Databricks, "LLM inference performance engineering", 2023) is its
memory-side twin, the bytes the model must move (every weight once per step,
each sequence's cached K/V read and the new K/V written) over peak HBM
bandwidth:

    MBU = model bytes / (seconds x GPUs x peak HBM bytes/s)

Each step's FLOPs and bytes come from the roofline of :mod:`~minibatch_engine.sim.roofline`
for the step's sequences (new tokens, context after the step), read back from
the trace. They count the model's work, not the engine's: no replicated KV
head, no all-reduce, no padding. Over a whole serving run the seconds are the
wall span of the run (first arrival to last token), idle time included, so a
lightly loaded deployment shows low figures by design.
"""
from __future__ import annotations

from typing import Iterable

from ..core.trace import StepRecord


def step_shapes(step: StepRecord) -> list[tuple[int, int]]:
    """The (new tokens, context after the step) of each sequence a step computed."""
    return [(lane.num_tokens, lane.start + lane.num_tokens) for lane in step.lanes
            if lane.kind != "pad" and lane.num_tokens > 0]


def model_flops_and_bytes(engine) -> tuple[float, float]:
    """The model's FLOPs and HBM bytes over every step of a simulated ``engine``'s trace."""
    roofline = engine.cost_model.roofline
    flops = nbytes = 0.0
    for step in engine.trace:
        shapes = step_shapes(step)
        if shapes:
            f, b = roofline.flops_and_bytes(shapes)
            flops, nbytes = flops + f, nbytes + b
    return flops, nbytes


def utilization(engines: Iterable, seconds: float, gpus_per_engine: int) -> dict:
    """MFU and MBU of simulated ``engines`` (one GPU kind) over ``seconds``, each
    engine on ``gpus_per_engine`` GPUs: ``{"mfu", "mbu", "model_flops", "model_bytes"}``."""
    engines = list(engines)
    if not engines or not seconds > 0:
        raise ValueError(f"need at least one engine and seconds > 0, got {len(engines)} and {seconds}")
    gpu = engines[0].cost_model.gpu
    flops = nbytes = 0.0
    for e in engines:
        f, b = model_flops_and_bytes(e)
        flops, nbytes = flops + f, nbytes + b
    gpus = gpus_per_engine * len(engines)
    return {"mfu": flops / (seconds * gpus * gpu.peak_flops), "mbu": nbytes / (seconds * gpus * gpu.hbm_bandwidth),
            "model_flops": flops, "model_bytes": nbytes}
