"""Why mixture-of-experts decode is bound by its *total* weights at moderate
batch and light on arithmetic at large batch, in numbers.

A decode step of ``B`` sequences runs ``2 x active`` FLOPs per token but reads
the experts its ``B k`` routing choices touch (:mod:`.moe`): ``k`` experts a
layer at ``B = 1``, nearly all of them a few dozen tokens later. Past that
point the step reads as many bytes as a dense model of the *total* size while
doing the arithmetic of one of the *active* size, so its arithmetic intensity
(FLOPs per byte) is ``active / total`` of the dense model's: Mixtral-8x7B needs
about ``total / active`` (3.6x) the batch of a dense model before its weight
reads stop binding (:func:`compute_bound_batch`).

:func:`decode_profile` prices decode steps with the calibrated cost model and
lists what binds; both functions serve chapter 14 and a deployment planner.
"""
from __future__ import annotations

from ..model.config import ModelConfig, get_preset
from .cost_model import CostModel
from .hardware import GPU, get_gpu
from .moe import expected_experts_touched, expert_bytes_read


def _resolve(model, gpu) -> tuple[ModelConfig, GPU]:
    return (get_preset(model) if isinstance(model, str) else model,
            get_gpu(gpu) if isinstance(gpu, str) else gpu)


def decode_profile(model: str | ModelConfig, gpu: str | GPU, batch_sizes=(1, 8, 64, 512), context: int = 1024,
                   **cost_model_options) -> list[dict]:
    """One row per batch size: a decode step of ``batch`` sequences, each with
    ``context`` tokens after the step, priced by :class:`~.cost_model.CostModel`
    (``cost_model_options``: ``tensor_parallel_size``, ``expert_parallel_size``,
    ``weight_dtype``, ...). Columns: routed experts touched per MoE layer, the
    weight and KV bytes the step reads (GB, one copy of the model), the share
    of the model's weights read, FLOPs per token, arithmetic intensity (step
    FLOPs over step bytes, and over weight bytes alone), the roofline's
    binding resource, and the calibrated step time and throughput."""
    model, gpu = _resolve(model, gpu)
    cm = CostModel(gpu, model, **cost_model_options)
    rows = []
    for b in batch_sizes:
        cost = cm.step_cost([(1, context)] * b)
        flops, nbytes = cm.roofline.flops_and_bytes([(1, context)] * b)
        weights = nbytes - b * context * cm.kv_bytes_per_token      # KV: b x (context - 1) read + b written
        touched = (expected_experts_touched(model.num_experts, model.num_experts_per_tok, b)
                   if model.is_moe else 0.0)
        rows.append({"batch": b, "experts touched": touched, "weights read GB": weights / 1e9,
                     "weights read / total": weights / cm.weight_bytes, "KV read GB": (nbytes - weights) / 1e9,
                     "GFLOP per token": flops / b / 1e9, "FLOP/byte": flops / nbytes,
                     "FLOP/weight byte": flops / weights, "bound": cost.bound,
                     "step ms": cost.seconds * 1e3, "tokens/s": b / cost.seconds})
    return rows


def compute_bound_batch(model: str | ModelConfig, gpu: str | GPU, weight_bytes_per_element: float = 2.0,
                        max_batch: int = 1 << 20) -> int:
    """The smallest decode batch whose projections' FLOPs take longer at peak
    than reading the weights they touch at full bandwidth: ``2 x active x B /
    peak >= weight bytes read(B) / bandwidth``, on one GPU, KV reads aside. A
    dense model's weight bytes do not grow with ``B``, so its answer is about
    the ridge point times ``bytes per weight / 2``; a mixture of experts reads
    more experts as ``B`` grows, so its answer is larger."""
    model, gpu = _resolve(model, gpu)
    active = model.num_parameters(include_embeddings=False,
                                  routed_experts=model.num_experts_per_tok if model.is_moe else None)
    routed_all = expert_bytes_read(model, float("inf"), weight_bytes_per_element)
    fixed = model.num_parameters(include_embeddings=False) * weight_bytes_per_element - routed_all

    def compute_wins(b: int) -> bool:
        read = fixed + expert_bytes_read(model, b, weight_bytes_per_element)
        return 2 * active * b / gpu.peak_flops >= read / gpu.hbm_bandwidth

    lo, hi = 1, 1
    while not compute_wins(hi):
        if hi >= max_batch:
            raise ValueError(f"{model.name} stays memory-bound up to a batch of {max_batch}")
        lo, hi = hi, min(2 * hi, max_batch)
    while lo < hi:                      # compute_wins is monotone in b: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if not compute_wins(mid) else (lo, mid)
    return hi
