"""What one operator of a transformer layer costs on a GPU: a calibrated model.

The ideal roofline (:mod:`.roofline`) says what a GPU *could* do; measured
kernels do less. Timings of the same layers on H100s and A100s (the Vidur
project's profiles, ``data/gpu-profiles/``) take 1.4-1.9x the ideal time,
worst near the ridge point, where neither the arithmetic nor the weight
stream hides the other. Each operator's time here is a formula with few
constants, fitted on those measurements by ``tools/calibrate_sim.py`` (the
constants and their provenance are in ``calibration.json``); nothing is
looked up by shape, so it predicts shapes and GPUs it never saw.

* A projection (a GEMM of ``M`` tokens, ``[M, K] x [K, N]`` in bf16):
  ``t = (t_c^p + t_m^p)^(1/p) + t0`` with ``t_c = 2MNK / (peak e_c)`` and
  ``t_m = 2 (MK + KN + MN) / (bandwidth e_m)``. The p-norm is a *soft* max:
  far from the ridge it is the larger term, at the ridge ``2^(1/p)`` times it.
* A norm, RoPE, the activation, a residual add, the embedding: the bytes
  they move at a fraction ``e`` of the HBM bandwidth, plus a fixed ``t0``.
* An all-reduce over ``n`` GPUs: ``alpha + 2 (n - 1) / n x bytes / busbw``,
  the bus bandwidth a measured fraction of the GPU's NVLink bandwidth. Past
  one node (``num_gpus > gpus_per_node``) the ring's slowest link is the
  network between nodes: that case is **extrapolated** (no all-reduce across
  nodes was measured): the measured 8-GPU fixed time plus one cross-node
  send/recv fixed time, and the ring's traffic at the measured cross-node
  point-to-point bandwidth (each GPU of a DGX has its own network card).
* A send/recv of ``bytes`` between two GPUs (the pipeline-parallel hand-over):
  ``alpha + bytes / bandwidth``, fitted within a node (NVLink, as a fraction
  of the GPU's) and across two nodes (the network's bytes/s). The network was
  measured between H100 DGX nodes; every GPU preset is given that network.

Every function takes plain numbers or numpy arrays (the calibration script
evaluates thousands of rows at once; the engine, one step at a time).
"""
from __future__ import annotations

from ..model.config import ModelConfig, get_preset
from .calibration import Calibration, default_calibration
from .hardware import GPU, get_gpu

BYTES = 2          # bf16 activations and weights
# the profiles' operator names: one layer's operators, in execution order
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
PROJECTIONS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


def gated(model: ModelConfig) -> bool:
    """Llama's MLP multiplies two projections (gate and up, fused); GPT-2's has one."""
    return model.family == "llama"


def projection_shape(op: str, model: ModelConfig, tp: int = 1) -> tuple[int, int]:
    """(K, N) of one GPU's shard of a projection under tensor parallelism ``tp``:
    QKV and gate/up split their outputs (column parallel), O and down their
    inputs (row parallel), as Megatron-LM shards them."""
    h, hd = model.hidden_size, model.head_dim
    if op == "attn_pre_proj":
        return h, (model.num_heads + 2 * model.num_kv_heads) * hd // tp
    if op == "attn_post_proj":
        return model.num_heads * hd // tp, h
    if op == "mlp_up_proj":
        return h, (2 if gated(model) else 1) * model.intermediate_size // tp
    if op == "mlp_down_proj":
        return model.intermediate_size // tp, h
    raise ValueError(f"{op!r} is not a projection; projections: {', '.join(PROJECTIONS)}")


def gemm_time(M, N, K, gpu: GPU, cal: Calibration | None = None, weight_bytes_per_element: float = BYTES):
    """Seconds for ``[M, K] x [K, N]`` in bf16 (the smooth roofline plus a fixed cost).
    ``weight_bytes_per_element``: the ``[K, N]`` weight read in fewer bytes (fp8,
    int4; :mod:`.precision`), at the bf16 GEMM's fitted rates: no quantized kernel
    was measured."""
    cal = cal or default_calibration()
    t_c = 2 * M * N * K / (gpu.peak_flops * cal.e_compute)
    t_m = (BYTES * (M * K + M * N) + weight_bytes_per_element * K * N) / (gpu.hbm_bandwidth * cal.e_memory)
    p = cal.p
    return (t_c ** p + t_m ** p) ** (1 / p) + cal.t0_s


def small_op_bytes(op: str, model: ModelConfig, M, tp: int = 1):
    """HBM bytes a memory-bound operator moves for ``M`` tokens (reads and writes)."""
    h, hd, f = model.hidden_size, model.head_dim, model.intermediate_size
    if op in ("input_layernorm", "post_attention_layernorm", "emb"):
        return 2 * BYTES * M * h                          # read x, write y (the hidden is not sharded)
    if op == "attn_rope":
        return 2 * BYTES * M * (model.num_heads + model.num_kv_heads) * hd // tp   # q and k, in place
    if op == "mlp_act":
        return (3 if gated(model) else 2) * BYTES * M * f // tp    # act(gate) x up: two reads, one write
    if op == "add":
        return 3 * BYTES * M * h
    raise ValueError(f"unknown memory-bound operator {op!r}")


def small_op_time(op: str, nbytes, gpu: GPU, cal: Calibration | None = None):
    """Seconds for a memory-bound operator moving ``nbytes`` (its own fitted
    efficiency, or the pooled one for an operator never measured)."""
    cal = cal or default_calibration()
    e, t0 = cal.small_ops.get(op, cal.small_ops["generic"])
    return nbytes / (gpu.hbm_bandwidth * e) + t0


GPUS_PER_NODE = 8      # an HGX/DGX H100, H200 or A100 node: eight GPUs on one NVLink switch


def all_reduce_time(nbytes, num_gpus: int, gpu: GPU, cal: Calibration | None = None,
                    gpus_per_node: int | None = None):
    """Seconds for an all-reduce of ``nbytes`` over ``num_gpus`` GPUs (0 for one):
    ring accounting, each GPU sends and receives ``2 (n - 1) / n`` of the message.
    With ``gpus_per_node`` and more GPUs than one node holds, the ring crosses
    the network (extrapolated: see the module's docstring); ``None`` keeps every
    GPU on one NVLink domain."""
    if num_gpus <= 1:
        return 0 * nbytes
    cal = cal or default_calibration()
    traffic = 2 * (num_gpus - 1) / num_gpus * nbytes
    if gpus_per_node is not None and num_gpus > gpus_per_node:
        alpha_net, network = cal.send_recv["across_nodes"]
        alpha = cal.all_reduce.get(gpus_per_node, cal.all_reduce["shared"])[0]
        return alpha + alpha_net + traffic / network
    alpha, fraction = cal.all_reduce.get(num_gpus, cal.all_reduce["shared"])
    return alpha + traffic / (fraction * gpu.nvlink_bandwidth)


def send_recv_time(nbytes, gpu: GPU, across_nodes: bool, cal: Calibration | None = None):
    """Seconds to send ``nbytes`` from one GPU to another (0 bytes cost nothing):
    within a node over NVLink, or ``across_nodes`` over the network, each from
    its fit on the measured H100 DGX send/recv (``calibration.json``)."""
    cal = cal or default_calibration()
    if not cal.send_recv:
        raise ValueError("this calibration holds no send/recv fit: rerun tools/calibrate_sim.py")
    if across_nodes:
        alpha, bandwidth = cal.send_recv["across_nodes"]
    else:
        alpha, fraction = cal.send_recv["within_node"]
        bandwidth = fraction * gpu.nvlink_bandwidth
    return (alpha + nbytes / bandwidth) * (nbytes > 0)


def layer_op_time(op: str, model: ModelConfig, M, tp: int, gpu: GPU, cal: Calibration | None = None):
    """Seconds of one of a layer's operators (``LAYER_OPS``) for ``M`` tokens."""
    if op in PROJECTIONS:
        K, N = projection_shape(op, model, tp)
        return gemm_time(M, N, K, gpu, cal)
    if op == "attn_rope" and model.family != "llama":
        return 0 * M                                      # learned positions: no rotary embedding
    return small_op_time(op, small_op_bytes(op, model, M, tp), gpu, cal)


def op_times(gpu: str | GPU, model: str | ModelConfig, num_tokens: int, tp: int = 1) -> dict[str, float]:
    """Seconds per layer of each operator for ``num_tokens`` tokens on one GPU of
    a ``tp``-way tensor-parallel group, keyed by the profiles' names
    (``add`` is one residual add; a layer has two). Attention itself (the
    kernel over the KV cache) is priced by the step's cost model, per sequence.
    For example ``op_times("H100-SXM", "llama-3-8b", 512)["mlp_up_proj"]`` is
    the gate and up projections of 512 tokens, in seconds.
    """
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    model = get_preset(model) if isinstance(model, str) else model
    if not isinstance(gpu, GPU):
        raise TypeError(f"gpu must be a GPU preset name or a GPU, got {gpu!r}")
    if not isinstance(model, ModelConfig):
        raise TypeError(f"model must be a preset name or a ModelConfig, got {model!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    check_tensor_parallel(model, tp)
    cal = default_calibration()
    return {op: float(layer_op_time(op, model, num_tokens, tp, gpu, cal)) for op in LAYER_OPS}


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """``tp`` must divide the attention heads and the MLP width (KV heads are
    replicated when there are fewer of them than GPUs, as vLLM does)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    for name, n in (("attention heads", model.num_heads), ("intermediate size", model.intermediate_size)):
        if n % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {model.name}'s {name} ({n})")
    if tp > model.num_kv_heads and tp % model.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} is not a multiple of {model.name}'s "
                         f"{model.num_kv_heads} KV heads (they are replicated across GPUs)")
