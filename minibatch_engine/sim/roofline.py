"""The ideal roofline of one engine step: what the GPU could do at its peaks.

step time = max(FLOPs / peak FLOP/s, bytes moved / HBM bandwidth) + overhead

* FLOPs: 2 x (non-embedding parameters) per new token for the matrix products,
  plus attention's QK^T and PV, 4 x layers x heads x head_dim per (query, key)
  pair, plus the LM head for the one row per sequence that is sampled.
* Bytes: every weight is read once per step (whatever the batch), each
  sequence's cached K/V is read once, and the new tokens' K/V written once.
* overhead: a fixed per-step cost (scheduling, kernel launches, sampling).
* speculative decoding: verifying k proposals is k + 1 query tokens of one
  sequence (and k + 1 rows of the LM head), priced like any other tokens; a
  draft model's k forwards are priced by the same roofline for the draft's
  shape (:meth:`draft_time`), with no per-step overhead (an assumption: engines
  run the draft's small steps back to back, e.g. under CUDA graphs).
* mixture of experts: FLOPs follow the active parameters (``k`` experts a
  token); the routed experts' bytes follow the experts the step's tokens touch
  in expectation (:func:`~.moe.expected_experts_touched`).
* swaps: KV blocks copied between host and device at the GPU's host-link
  bandwidth, not overlapped with compute (preemption, chapter 6).

It ignores activations' traffic, kernel efficiency and the order kernels run
in (it lets the whole step's arithmetic hide its whole memory traffic): a lower
bound that is right about *which* resource binds, which is what chapter 1 uses
it for. Measured kernels take 1.4-1.9x as long; the engine's simulator prices
each operator as measured (:mod:`.cost_model`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..model.config import ModelConfig
from .hardware import GPU
from .moe import expected_experts_touched, routed_expert_parameters


@dataclass
class StepCost:
    """A step's FLOPs and bytes, its seconds, which roofline resource binds
    (``"compute"`` or ``"memory"``) and, from the calibrated model, the seconds
    by part (``parts``: projections, attention, ..., host)."""
    flops: float
    bytes: float
    seconds: float
    bound: str      # "compute" or "memory"
    parts: dict[str, float] = field(default_factory=dict)


class RooflineCostModel:
    """The ideal step of ``model`` on ``gpu``: every parameter in ``bytes_per_param``
    bytes (or ``weight_bytes`` in all, for mixed precisions: :mod:`.precision`),
    every cached K/V element in ``kv_bytes_per_element`` (or ``kv_bytes_per_token``
    in all, scales included)."""

    def __init__(self, gpu: GPU, model: ModelConfig, bytes_per_param: int = 2,
                 kv_bytes_per_element: int = 2, step_overhead_s: float = 1e-3,
                 weight_bytes: float | None = None, kv_bytes_per_token: int | None = None,
                 routed_expert_bytes: float | None = None):
        self.gpu, self.model = gpu, model
        self.bytes_per_param, self.kv_bytes_per_element = bytes_per_param, kv_bytes_per_element
        self.step_overhead_s = step_overhead_s
        # the projections a token runs through (a mixture of experts: its k routed experts)
        self.linear_params = model.num_parameters(
            include_embeddings=False, routed_experts=model.num_experts_per_tok if model.is_moe else None)
        self.weight_bytes = model.num_parameters() * bytes_per_param if weight_bytes is None else weight_bytes
        self.routed_expert_bytes = (routed_expert_parameters(model) * bytes_per_param if routed_expert_bytes is None
                                    else routed_expert_bytes)     # part of weight_bytes
        self.kv_bytes_per_token = (model.kv_bytes_per_token(kv_bytes_per_element) if kv_bytes_per_token is None
                                   else kv_bytes_per_token)

    def flops_and_bytes(self, shapes: list[tuple[int, int]], logits_rows: int | None = None) -> tuple[float, float]:
        """A step's FLOPs and HBM bytes over sequences given as (new tokens q,
        context after the step n); ``logits_rows``: rows of the LM head
        (default one per sequence)."""
        m = self.model
        tokens = sum(q for q, _ in shapes)
        # new token i (1..q) of a sequence with n - q cached tokens attends to n - q + i keys
        pairs = sum(q * (n - q) + q * (q + 1) // 2 for q, n in shapes)
        flops = (2 * self.linear_params * tokens
                 + 4 * m.num_layers * m.num_heads * m.head_dim * pairs
                 + 2 * m.hidden_size * m.vocab_size * (len(shapes) if logits_rows is None else logits_rows))
        kv_read = sum(n - q for q, n in shapes) * self.kv_bytes_per_token
        kv_write = tokens * self.kv_bytes_per_token
        weights = self.weight_bytes
        if m.is_moe:      # the routed experts no token of this step touches stay unread
            untouched = 1 - expected_experts_touched(m.num_experts, m.num_experts_per_tok, tokens) / m.num_experts
            weights -= self.routed_expert_bytes * untouched
        return flops, weights + kv_read + kv_write

    def step_cost(self, shapes: list[tuple[int, int]], logits_rows: int | None = None) -> StepCost:
        """Cost of one step over sequences given as (new tokens q, context after the step n);
        ``logits_rows``: rows of the LM head (default one per sequence)."""
        flops, nbytes = self.flops_and_bytes(shapes, logits_rows)
        t_compute, t_memory = flops / self.gpu.peak_flops, nbytes / self.gpu.hbm_bandwidth
        bound = "compute" if t_compute >= t_memory else "memory"
        return StepCost(flops, nbytes, max(t_compute, t_memory) + self.step_overhead_s, bound)

    def swap_time(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` of KV cache between host and device."""
        return nbytes / self.gpu.host_link_bandwidth

    def step_time(self, shapes: list[tuple[int, int]], swap_bytes: int = 0,
                  logits_rows: int | None = None) -> float:
        return (self.step_cost(shapes, logits_rows).seconds if shapes else 0.0) + self.swap_time(swap_bytes)

    def draft_time(self, steps: list[list[tuple[int, int]]]) -> float:
        """Seconds for a draft model's forwards (call it on a cost model built for
        the draft's shape, with ``step_overhead_s=0``), each forward given as its
        sequences' (new tokens, context) shapes."""
        return sum(self.step_cost(shapes).seconds for shapes in steps if shapes)

    def __repr__(self) -> str:
        return (f"RooflineCostModel({self.model.name} on {self.gpu.name}, "
                f"overhead {self.step_overhead_s * 1e3:g} ms/step)")
