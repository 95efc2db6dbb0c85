"""A roofline cost model of one engine step.

step time = max(FLOPs / peak FLOP/s, bytes moved / HBM bandwidth) + overhead

* FLOPs: 2 x (non-embedding parameters) per new token for the matrix products,
  plus attention's QK^T and PV, 4 x layers x heads x head_dim per (query, key)
  pair, plus the LM head for the one row per sequence that is sampled.
* Bytes: every weight is read once per step (whatever the batch), each
  sequence's cached K/V is read once, and the new tokens' K/V written once.
* overhead: a fixed per-step cost (scheduling, kernel launches, sampling).
* swaps: KV blocks copied between host and device at the GPU's host-link
  bandwidth, not overlapped with compute (preemption, chapter 6).

It ignores activations' traffic, kernel efficiency and overlap: a lower bound
that is right about *which* resource binds, which is what the book uses it for.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.config import ModelConfig
from .hardware import GPU


@dataclass
class StepCost:
    flops: float
    bytes: float
    seconds: float
    bound: str      # "compute" or "memory"


class RooflineCostModel:
    def __init__(self, gpu: GPU, model: ModelConfig, bytes_per_param: int = 2,
                 kv_bytes_per_element: int = 2, step_overhead_s: float = 1e-3):
        self.gpu, self.model = gpu, model
        self.bytes_per_param, self.kv_bytes_per_element = bytes_per_param, kv_bytes_per_element
        self.step_overhead_s = step_overhead_s
        self.linear_params = model.num_parameters(include_embeddings=False)
        self.weight_bytes = model.num_parameters() * bytes_per_param
        self.kv_bytes_per_token = model.kv_bytes_per_token(kv_bytes_per_element)

    def step_cost(self, shapes: list[tuple[int, int]]) -> StepCost:
        """Cost of one step over sequences given as (new tokens q, context after the step n)."""
        m = self.model
        tokens = sum(q for q, _ in shapes)
        # new token i (1..q) of a sequence with n - q cached tokens attends to n - q + i keys
        pairs = sum(q * (n - q) + q * (q + 1) // 2 for q, n in shapes)
        flops = (2 * self.linear_params * tokens
                 + 4 * m.num_layers * m.num_heads * m.head_dim * pairs
                 + 2 * m.hidden_size * m.vocab_size * len(shapes))
        kv_read = sum(n - q for q, n in shapes) * self.kv_bytes_per_token
        kv_write = tokens * self.kv_bytes_per_token
        nbytes = self.weight_bytes + kv_read + kv_write
        t_compute, t_memory = flops / self.gpu.peak_flops, nbytes / self.gpu.hbm_bandwidth
        bound = "compute" if t_compute >= t_memory else "memory"
        return StepCost(flops, nbytes, max(t_compute, t_memory) + self.step_overhead_s, bound)

    def swap_time(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` of KV cache between host and device."""
        return nbytes / self.gpu.host_link_bandwidth

    def step_time(self, shapes: list[tuple[int, int]], swap_bytes: int = 0) -> float:
        return (self.step_cost(shapes).seconds if shapes else 0.0) + self.swap_time(swap_bytes)

    def __repr__(self) -> str:
        return (f"RooflineCostModel({self.model.name} on {self.gpu.name}, "
                f"overhead {self.step_overhead_s * 1e3:g} ms/step)")
