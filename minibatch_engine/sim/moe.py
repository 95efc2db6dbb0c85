"""Mixture of experts in the simulator: the experts a step reads, their GEMMs,
and expert parallelism's all-to-all.

A mixture-of-experts layer (Shazeer et al. 2017; Mixtral, DeepSeek-V3,
Qwen3-MoE) sends each token to ``k`` of its ``E`` routed experts. A step's
arithmetic follows the *active* parameters (``k`` experts a token), but its
weight reads follow the experts the *batch* touches. With ``B`` tokens routed
uniformly, an expert escapes all of them with probability ``(1 - k/E)^B``, so
the step reads

    D(B) = E x (1 - (1 - k/E)^B)

experts in expectation (:func:`expected_experts_touched`): ``k`` at ``B = 1``,
nearly all ``E`` once ``B`` is a few times ``E / k``. Decode is therefore bound
by the *total* weights at moderate batch (every expert read for few tokens
each), and only a large batch gives each expert enough tokens to use the GPU's
arithmetic.

**The expert phase** runs as one grouped GEMM for gate/up and one for down
(vLLM's fused MoE kernel): ``D`` experts, each with ``m = B k / D`` tokens on
average, each priced by the calibrated :func:`~.operators.gemm_time` at ``m``
tokens without its fixed cost, plus one fixed cost per grouped kernel. No
grouped GEMM was measured: this assumes an expert's tile runs like a lone
GEMM of its size.

**Expert parallelism** (``expert_parallel_size = ep``; GShard, DeepSeek-V3):
each of ``ep`` GPUs holds ``E / ep`` whole experts of every MoE layer, and the
attention and dense parts run data-parallel (each GPU holds them whole and
runs its share of the batch's sequences), as DeepSeek-V3 serves and as vLLM's
``--data-parallel-size ep --enable-expert-parallel`` does. Each MoE layer adds
two all-to-alls: *dispatch* sends every token's hidden state to the GPUs of
its ``k`` experts, *combine* brings the results back. Combining EP with tensor
parallelism is not modelled (refused), nor is EP across nodes.

**Load imbalance** (``expert_load_imbalance``, ``rho``): the busiest GPU's
routed tokens over the mean GPU's (DeepSeek's EPLB reports the same ratio;
1.0 = uniform). The layer waits for the busiest GPU, so its expert GEMMs and
its share of both all-to-alls carry ``rho`` times the mean load. A small batch
is uneven whatever the router does: its few experts sit on a few GPUs, so the
busiest GPU reads at least one whole expert (at ``B = 1`` and ``ep = 8``, one
of Mixtral's two, not a quarter of one). With one GPU group (``ep = 1``) there
is no busiest GPU, and ``rho`` must be 1.

**The all-to-all is extrapolated.** ``data/gpu-profiles/network/h100_dgx/``
measured all-reduces (and point-to-point sends), not all-to-alls. Inside one
NVSwitch node every GPU reaches every other at its full NVLink bandwidth, so
an all-to-all is bound by each GPU's own link: it sends ``(ep - 1) / ep`` of
its buffer and receives as much. A ring all-reduce drives the same links with
``2 (n - 1) / n`` of its message, and its fit (``calibration.json``: a fixed
cost ``alpha`` and a bus bandwidth, per GPU count) says what NCCL reached
there. :func:`all_to_all_time` assumes an all-to-all reaches that same bus
bandwidth and fixed cost. It also sends a token once per expert, even when
two of its experts sit on one GPU (DeepEP sends once per node); both make
the estimate conservative.
"""
from __future__ import annotations

import math

from ..core.checks import check_number
from ..model.config import ModelConfig
from .calibration import Calibration, default_calibration
from .hardware import GPU
from .operators import BYTES, gemm_time, small_op_time

MAX_EP_GPUS = 8            # one NVLink node: the measured collectives go no further


def expected_experts_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts ``tokens`` tokens touch in expectation when each picks
    ``top_k`` of ``num_experts`` uniformly: ``E (1 - (1 - k/E)^B)``."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def check_expert_parallel(model: ModelConfig, ep: int, tp: int = 1, load_imbalance: float = 1.0) -> None:
    """Refuse an expert-parallel layout this model cannot take, naming the field."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"expert_parallel_size must be a positive integer, got {ep!r}")
    check_number("expert_load_imbalance", load_imbalance, 1.0, math.inf)
    if model.is_moe and tp > 1:
        for name, n in (("moe_intermediate_size", model.moe_intermediate_size),):
            if n % tp:
                raise ValueError(f"tensor_parallel_size {tp} does not divide {model.name}'s {name} ({n})")
    if ep == 1:
        if load_imbalance != 1.0:
            raise ValueError(f"expert_load_imbalance {load_imbalance} needs expert_parallel_size > 1: with one "
                             "GPU group every GPU holds a slice of every expert, so no GPU is the busiest")
        return
    if not model.is_moe:
        raise ValueError(f"expert_parallel_size {ep} needs a mixture-of-experts model; {model.name} is dense "
                         "(try mixtral-8x7b, qwen3-30b-a3b, qwen3-235b-a22b or deepseek-v3-like)")
    if model.num_experts % ep:
        raise ValueError(f"expert_parallel_size {ep} does not divide {model.name}'s {model.num_experts} experts")
    if tp > 1:
        raise ValueError(f"expert_parallel_size {ep} with tensor_parallel_size {tp}: expert parallelism here runs "
                         "attention data-parallel on the ep GPUs; use tensor_parallel_size 1 with it")
    if load_imbalance > ep:
        raise ValueError(f"expert_load_imbalance {load_imbalance} exceeds expert_parallel_size {ep}: the busiest "
                         "of ep GPUs carries at most all the tokens, ep times the mean")
    if ep > MAX_EP_GPUS:
        raise ValueError(f"expert_parallel_size {ep} spans nodes: the measured collectives cover one "
                         f"{MAX_EP_GPUS}-GPU NVLink node, so at most {MAX_EP_GPUS}")


def all_to_all_time(nbytes, num_gpus: int, gpu: GPU, cal: Calibration | None = None):
    """Seconds for an all-to-all in which each of ``num_gpus`` GPUs holds
    ``nbytes`` for all destinations (``(n - 1) / n`` of it leaves the GPU), 0
    for one GPU. Extrapolated from the all-reduce fit (see the module's note)."""
    if num_gpus <= 1:
        return 0 * nbytes
    cal = cal or default_calibration()
    alpha, fraction = cal.all_reduce.get(num_gpus, cal.all_reduce["shared"])
    return alpha + (num_gpus - 1) / num_gpus * nbytes / (fraction * gpu.nvlink_bandwidth)


def grouped_gemm_time(experts: float, tokens_each: float, N: int, K: int, gpu: GPU, cal: Calibration,
                      weight_bytes_per_element: float = BYTES) -> float:
    """Seconds for one grouped GEMM over ``experts`` experts with ``tokens_each``
    tokens each (``[m, K] x [K, N]`` per expert): each at the calibrated GEMM's
    rate, one fixed cost for the kernel."""
    if experts <= 0:
        return 0.0
    one = gemm_time(tokens_each, N, K, gpu, cal, weight_bytes_per_element) - cal.t0_s
    return experts * one + cal.t0_s


def moe_layer_seconds(model: ModelConfig, tokens: int, gpu: GPU, cal: Calibration | None = None, tp: int = 1,
                      ep: int = 1, load_imbalance: float = 1.0,
                      weight_bytes_per_element: float = BYTES) -> dict[str, float]:
    """One MoE layer's MLP on the busiest GPU, for a step of ``tokens`` tokens
    (all GPUs together): the router, the routed experts' grouped GEMMs and
    activation, the shared experts, and (``ep > 1``) dispatch and combine.
    Attention and the residual stream are the cost model's, as for a dense layer."""
    cal = cal or default_calibration()
    d, f, E, k = model.hidden_size, model.moe_intermediate_size, model.num_experts, model.num_experts_per_tok
    local_tokens = math.ceil(tokens / ep)                 # this GPU's share of the sequences' tokens
    touched = expected_experts_touched(E, k, tokens)
    # the busiest GPU: rho x the mean GPU's experts and token-expert pairs, and whole ones:
    # a small batch's few experts sit on a few GPUs, each reading at least one expert
    experts = max(touched / ep, min(touched, 1.0))
    routed = max(load_imbalance * tokens * k / ep, min(tokens * k, experts))
    each = routed / experts if experts else 0.0
    width = f // tp
    expert_s = (grouped_gemm_time(experts, each, 2 * width, d, gpu, cal, weight_bytes_per_element)
                + grouped_gemm_time(experts, each, d, width, gpu, cal, weight_bytes_per_element)
                + small_op_time("mlp_act", 3 * BYTES * routed * width, gpu, cal))
    shared = 0.0
    if model.num_shared_experts:
        sw = model.num_shared_experts * width
        shared = (gemm_time(local_tokens, 2 * sw, d, gpu, cal, weight_bytes_per_element)
                  + gemm_time(local_tokens, d, sw, gpu, cal, weight_bytes_per_element)
                  + small_op_time("mlp_act", 3 * BYTES * local_tokens * sw, gpu, cal))
    router = gemm_time(local_tokens, E, d, gpu, cal) + small_op_time("generic", BYTES * local_tokens * E, gpu, cal)
    parts = {"router": router, "experts": expert_s, "shared experts": shared}
    if ep > 1:
        parts["all-to-all"] = 2 * all_to_all_time(routed * d * BYTES, ep, gpu, cal)   # dispatch and combine
    return parts


def routed_expert_parameters(model: ModelConfig) -> int:
    """Parameters of every routed expert, all MoE layers (0 for a dense model)."""
    return model.num_moe_layers * model.num_experts * model.expert_parameters


def expert_bytes_read(model: ModelConfig, tokens: float, bytes_per_element: float = BYTES) -> float:
    """Routed-expert weight bytes a step of ``tokens`` tokens reads, all MoE
    layers (one copy): the experts it touches in expectation."""
    if not model.is_moe:
        return 0.0
    touched = expected_experts_touched(model.num_experts, model.num_experts_per_tok, tokens)
    return model.num_moe_layers * touched * model.expert_parameters * bytes_per_element
