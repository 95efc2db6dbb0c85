"""The simulator's cost of one engine step: each operator as measured, in the
order the kernels run, plus the CPU's share.

A GPU runs a step's kernels one after another, so their times add up: the
projections' arithmetic does not hide the attention kernel's KV reads. Per
layer: input norm, QKV projection, RoPE, the KV-cache write, attention, O
projection, a residual add, post-attention norm, gate and up projections,
activation, down projection, a residual add, and with tensor parallelism two
all-reduces. Once per step: the embedding, the final norm, the LM head over
the rows that sample, and sampling. Each comes from :mod:`.operators`, whose
constants are fitted on measured H100 and A100 timings (``calibration.json``).

Attention is priced per sequence the way a varlen paged kernel runs them in
one launch: a sequence with new tokens takes the larger of its causal FLOPs at
the kernel's compute efficiency and its context's K/V bytes at the kernel's
memory efficiency (a prefill is compute-bound, a decode memory-bound); the
sequences' times add up, plus one fixed kernel cost per layer. The profiles
hold no attention kernel, so those two efficiencies are assumptions
(:class:`~.calibration.Calibration` says which, and why).

KV cache and weights are priced by their bytes (:mod:`.precision`): an fp8 or
int8 KV cache (``kv_cache_dtype``) about halves the bytes the attention kernel
and the KV write move (one byte a value, and a scale per token and head); fp8 or int4 projection weights (``weight_dtype``) cut the
weight bytes each projection reads. No quantized kernel was measured, so both
run at the bf16 kernels' fitted rates (:mod:`.precision` says what that misses).

A mixture-of-experts layer replaces the MLP by a router, the grouped GEMMs of
the experts the step's tokens touch, shared experts and, with expert
parallelism, a dispatch and a combine all-to-all (:mod:`.moe`). Under expert
parallelism the attention runs data-parallel: each GPU takes every
``ep``-th sequence, and the GPU with the most tokens sets the step's pace.

The CPU side of a step is its own term: ``step_overhead_s`` for scheduling and
input preparation, and a launch cost per kernel. Launches run ahead of the
GPU, so the GPU's time and the launches overlap; a CUDA graph replaces a
decode step's launches by one. With ``async_scheduling`` the next step is
scheduled while the GPU runs, so the host's work hides behind the GPU's.

Pipeline parallelism (``pipeline_parallel_size`` > 1) splits the layers into
stages (:mod:`.pipeline` says how, and which schedule prices a step); each
stage is ``tensor_parallel_size`` GPUs. GPUs sit ``gpus_per_node`` to a node,
stages in order: an all-reduce within a node runs on NVLink, one spanning
nodes on the network (extrapolated, :mod:`.operators`), and a hand-over
between stages on whichever link joins them.
"""
from __future__ import annotations

import math

from ..model.config import ModelConfig
from .calibration import Calibration, default_calibration
from .hardware import GPU
from .moe import check_expert_parallel, moe_layer_seconds, routed_expert_parameters
from .operators import (BYTES, GPUS_PER_NODE, all_reduce_time, check_tensor_parallel, gemm_time, layer_op_time,
                        projection_shape, send_recv_time, small_op_bytes, small_op_time)
from .pipeline import (HANDOVER_TENSORS, PipelineTiming, handover_crosses_nodes, pipeline_time, split_microbatches,
                       stage_layers)
from .precision import (ACTIVATION_BYTES, kv_bytes_per_token_head, projection_parameters, weight_bytes,
                        weight_bytes_per_element)
from .roofline import RooflineCostModel, StepCost

KERNELS_PER_LAYER = 12     # two norms, QKV, RoPE, KV write, attention, O, two adds, up, activation, down
KERNELS_PER_STEP = 5       # embedding, final norm, LM head, sampling, the copy of the sampled ids
MOE_KERNELS = 6            # router, top-k, gate/up grouped GEMM, activation, down grouped GEMM, weighted sum


class CostModel:
    """Seconds for one step of ``model`` on ``tensor_parallel_size`` x
    ``pipeline_parallel_size`` GPUs of one kind, ``gpus_per_node`` to a node.

    ``step_overhead_s``: the host's scheduling and input preparation per step.
    ``cuda_graphs``: decode-only steps replay a graph (one launch).
    ``async_scheduling``: the host's work overlaps the GPU's (vLLM's
    ``--async-scheduling``). ``calibration``: the constants (default: the
    committed fit). ``kv_cache_dtype`` (``"auto"`` = bf16, ``"fp8"``, ``"int8"``)
    and ``weight_dtype`` (``"auto"`` = bf16, ``"fp8"``, ``"int4"``): the bytes the
    KV cache and the projection weights are read in (:mod:`.precision`).
    ``expert_parallel_size`` (a mixture of experts): experts split over that many
    GPUs, attention data-parallel across them (:mod:`.moe`);
    ``expert_load_imbalance``: the busiest of those GPUs' routed tokens over the
    mean (1.0 = uniform).
    """

    def __init__(self, gpu: GPU, model: ModelConfig, tensor_parallel_size: int = 1,
                 step_overhead_s: float = 1e-3, cuda_graphs: bool = True, async_scheduling: bool = False,
                 calibration: Calibration | None = None, kv_cache_dtype: str = "auto",
                 weight_dtype: str = "auto", pipeline_parallel_size: int = 1, gpus_per_node: int = GPUS_PER_NODE,
                 expert_parallel_size: int = 1, expert_load_imbalance: float = 1.0):
        check_tensor_parallel(model, tensor_parallel_size)
        check_expert_parallel(model, expert_parallel_size, tensor_parallel_size, expert_load_imbalance)
        if pipeline_parallel_size > 1 and model.is_moe:
            raise ValueError(f"pipeline_parallel_size > 1 with a mixture of experts ({model.name}) is not "
                             "simulated; use expert_parallel_size or tensor_parallel_size")
        self.stage_layers = stage_layers(model.num_layers, pipeline_parallel_size)   # checks pp
        self.gpu, self.model, self.tp, self.pp = gpu, model, tensor_parallel_size, pipeline_parallel_size
        self.ep, self.load_imbalance = expert_parallel_size, expert_load_imbalance
        self.num_gpus = tensor_parallel_size * pipeline_parallel_size * expert_parallel_size
        self.gpus_per_node = gpus_per_node
        self.step_overhead_s, self.cuda_graphs, self.async_scheduling = step_overhead_s, cuda_graphs, async_scheduling
        self.cal = calibration or default_calibration()
        self.kv_cache_dtype, self.weight_dtype = kv_cache_dtype, weight_dtype
        kv_head = kv_bytes_per_token_head(model.head_dim, kv_cache_dtype)     # one token, one KV head: K or V
        self.weight_elem = weight_bytes_per_element(weight_dtype)
        routed = routed_expert_parameters(model) * self.weight_elem
        self.roofline = RooflineCostModel(gpu, model, step_overhead_s=0.0, weight_bytes=weight_bytes(model, weight_dtype),
                                          kv_bytes_per_token=2 * model.num_layers * model.num_kv_heads * kv_head,
                                          routed_expert_bytes=routed)
        self.weight_bytes = self.roofline.weight_bytes                     # one copy of the model
        self.kv_bytes_per_token = self.roofline.kv_bytes_per_token         # all layers, all GPUs
        self.linear_params = self.roofline.linear_params                   # parameters in the projections (active)
        # weights held by all GPUs together: expert parallelism copies all but the routed experts to every GPU
        self.resident_weight_bytes = (self.weight_bytes if self.ep == 1
                                      else self.ep * (self.weight_bytes - routed) + routed)
        self.stage_weight_bytes = self._stage_weight_bytes()                # each stage's, its tp GPUs together
        self.weight_bytes_per_gpu = (self.resident_weight_bytes / self.num_gpus if pipeline_parallel_size == 1
                                     else max(self.stage_weight_bytes) / tensor_parallel_size)   # the fullest GPU
        tp, m = tensor_parallel_size, model
        # KV heads are split across the GPUs, or replicated when there are fewer heads than GPUs
        self.kv_heads_per_gpu = math.ceil(m.num_kv_heads / tp)
        self.kv_replication = tp * self.kv_heads_per_gpu / m.num_kv_heads
        self.kv_bytes_per_token_layer = 2 * self.kv_heads_per_gpu * kv_head   # K and V, one GPU
        self.heads_per_gpu = m.num_heads // tp
        self._projections = [projection_shape(op, m, tp) for op in
                             ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")]

    # --- the GPU's part -----------------------------------------------------------------
    def _layer_seconds(self, tokens: int, dense_mlp: bool = True) -> dict[str, float]:
        """One layer's operators for ``tokens`` new tokens, attention aside
        (``dense_mlp=False``: without the MLP, which a MoE layer prices apart)."""
        gpu, cal, m, tp = self.gpu, self.cal, self.model, self.tp
        small = 0.0
        ops = ("input_layernorm", "post_attention_layernorm", "mlp_act", "add", "add", "attn_rope")
        for op in (ops if dense_mlp else tuple(o for o in ops if o != "mlp_act")):
            small += layer_op_time(op, m, tokens, tp, gpu, cal)
        small += small_op_time("kv_write", tokens * self.kv_bytes_per_token_layer * 2, gpu, cal)   # read + write
        projections = self._projections if dense_mlp else self._projections[:2]
        return {"projections": sum(gemm_time(tokens, N, K, gpu, cal, self.weight_elem) for K, N in projections),
                "small operators": small,
                "all-reduce": 2 * all_reduce_time(tokens * m.hidden_size * BYTES, tp, gpu, cal, self.gpus_per_node)}

    def attention_seconds(self, shapes: list[tuple[int, int]]) -> float:
        """One layer's attention kernel over every sequence of the step."""
        cal, gpu = self.cal, self.gpu
        flop_rate = gpu.peak_flops * cal.attention_e_compute
        byte_rate = gpu.hbm_bandwidth * cal.attention_e_memory
        per_pair = 4 * self.heads_per_gpu * self.model.head_dim       # QK^T and PV, per (query, key)
        total = 0.0
        for q, n in shapes:
            pairs = q * (n - q) + q * (q + 1) // 2
            total += max(per_pair * pairs / flop_rate, n * self.kv_bytes_per_token_layer / byte_rate)
        return total + cal.t0_s

    def _once_seconds(self, tokens: int, rows: int) -> dict[str, float]:
        gpu, cal, m = self.gpu, self.cal, self.model
        norm_and_embedding = (small_op_time("emb", small_op_bytes("emb", m, tokens), gpu, cal)
                              + small_op_time("input_layernorm", small_op_bytes("input_layernorm", m, tokens),
                                              gpu, cal))
        lm_head = gemm_time(rows, m.vocab_size // self.tp, m.hidden_size, gpu, cal)
        lm_head += all_reduce_time(rows * m.vocab_size * BYTES / 2, self.tp, gpu, cal,
                                   self.gpus_per_node)   # gather ~ half a reduce
        sampling = small_op_time("sampling", rows * m.vocab_size * 4 * 2, gpu, cal)     # fp32 logits, two passes
        return {"embedding and final norm": norm_and_embedding, "LM head": lm_head, "sampling": sampling}

    def gpu_seconds(self, shapes: list[tuple[int, int]], logits_rows: int | None = None) -> dict[str, float]:
        """The GPU's seconds for a step, by part (with pipeline stages: the
        stages' average by part, and the ``"pipeline bubble"``)."""
        if self.pp > 1:
            return self._pipeline(shapes, logits_rows)[1]
        tokens = sum(q for q, _ in shapes)
        rows = len(shapes) if logits_rows is None else logits_rows
        if self.model.is_moe:
            return self._moe_gpu_seconds(shapes, tokens, rows)
        layers = self.model.num_layers
        parts = {k: layers * v for k, v in self._layer_seconds(tokens).items()}
        parts["attention"] = layers * self.attention_seconds(shapes)
        parts.update(self._once_seconds(tokens, rows))
        return parts

    # --- pipeline parallelism -----------------------------------------------------------
    def _stage_weight_bytes(self) -> tuple[float, ...]:
        """Bytes of weights each stage holds (its ``tp`` GPUs together): its
        layers, the embedding on the first, the final norm and the LM head on the
        last (tied embeddings: the last stage keeps its own copy when ``pp`` > 1)."""
        m, L = self.model, self.model.num_layers
        final_norm = 2 * m.hidden_size if m.family == "gpt2" else m.hidden_size
        projections = projection_parameters(m) / L
        rest = (m.num_parameters(include_embeddings=False) - final_norm) / L - projections
        per_layer = projections * self.weight_elem + rest * ACTIVATION_BYTES
        embeddings = (m.num_parameters() - m.num_parameters(include_embeddings=False)) * ACTIVATION_BYTES
        head = m.vocab_size * m.hidden_size * ACTIVATION_BYTES
        first = embeddings - (0 if m.tie_word_embeddings else head)
        last = head + final_norm * ACTIVATION_BYTES
        if self.pp == 1:
            return (float(self.weight_bytes),)
        return tuple(n * per_layer + (first if s == 0 else 0) + (last if s == self.pp - 1 else 0)
                     for s, n in enumerate(self.stage_layers))

    def kv_memory_bytes(self, usable_per_gpu: float) -> int:
        """KV memory of all the GPUs when each has ``usable_per_gpu`` bytes: what is
        left beside the weights. A token's KV lives on every stage (its layers'
        share), so the fullest stage, per layer, sets how many tokens fit."""
        if self.pp == 1:
            return int(self.tp * usable_per_gpu - self.weight_bytes)
        L = self.model.num_layers
        return int(min((self.tp * usable_per_gpu - w) * L / n
                       for w, n in zip(self.stage_weight_bytes, self.stage_layers)))

    def _microbatch_seconds(self, shapes, rows: int) -> dict[str, dict[str, float]]:
        """One micro-batch's seconds by part: per layer, on the first stage only,
        and on the last stage only."""
        gpu, cal, m = self.gpu, self.cal, self.model
        tokens = sum(q for q, _ in shapes)
        layer = self._layer_seconds(tokens)
        layer["attention"] = self.attention_seconds(shapes)
        once = self._once_seconds(tokens, rows)
        embedding = small_op_time("emb", small_op_bytes("emb", m, tokens), gpu, cal)
        last = {"embedding and final norm": once["embedding and final norm"] - embedding,
                "LM head": once["LM head"], "sampling": once["sampling"]}
        return {"layer": layer, "first": {"embedding and final norm": embedding}, "last": last}

    def _stage_seconds(self, stage: int, micro: dict) -> dict[str, float]:
        """A micro-batch's seconds by part on ``stage`` (from :meth:`_microbatch_seconds`)."""
        parts = {k: self.stage_layers[stage] * v for k, v in micro["layer"].items()}
        for which, here in (("first", stage == 0), ("last", stage == self.pp - 1)):
            for k, v in micro[which].items() if here else ():
                parts[k] = parts.get(k, 0.0) + v
        return parts

    def _handover_seconds(self, stage: int, tokens: int) -> float:
        """One micro-batch's activations from ``stage`` to the next: each of the
        ``tp`` GPU pairs sends its 1/tp share at once (as vLLM splits it), then
        the receiving stage all-gathers them (priced as half an all-reduce)."""
        nbytes = HANDOVER_TENSORS * tokens * self.model.hidden_size * BYTES
        across = handover_crosses_nodes(stage, self.tp, self.gpus_per_node)
        gather = all_reduce_time(nbytes, self.tp, self.gpu, self.cal, self.gpus_per_node) / 2
        return send_recv_time(nbytes / self.tp, self.gpu, across, self.cal) + gather

    def _pipeline(self, shapes, logits_rows=None, microbatches=None, schedule="steady"):
        """The step's :class:`PipelineTiming`, and the GPU seconds by part (the
        stages' average, plus the bubble) that add up to its seconds."""
        m = min(self.pp, len(shapes)) if microbatches is None else microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        batches = split_microbatches(shapes, m)
        rows = len(shapes) if logits_rows is None else logits_rows
        share = [rows * len(b) // len(shapes) for b in batches]
        share[0] += rows - sum(share)
        per = [self._microbatch_seconds(b, r) for b, r in zip(batches, share)]
        cells = [[self._stage_seconds(s, p) for p in per] for s in range(self.pp)]   # [stage][micro-batch]
        t = [[sum(c.values()) for c in row] for row in cells]
        tokens = [sum(q for q, _ in b) for b in batches]
        h = [[self._handover_seconds(s, n) for n in tokens] for s in range(self.pp - 1)]
        back = handover_crosses_nodes(0, (self.pp - 1) * self.tp, self.gpus_per_node)
        r = [send_recv_time(8 * n, self.gpu, back, self.cal) if self.pp > 1 else 0.0
             for n in share]                                                    # the sampled ids (int64)
        timing = pipeline_time(t, h, r, schedule)
        parts: dict[str, float] = {}
        for row in cells:
            for c in row:
                for k, v in c.items():
                    parts[k] = parts.get(k, 0.0) + v / self.pp
        parts["pipeline bubble"] = timing.seconds - sum(timing.stage_busy) / self.pp
        return timing, parts

    def pipeline_timing(self, shapes: list[tuple[int, int]], logits_rows: int | None = None,
                        microbatches: int | None = None, schedule: str = "steady") -> PipelineTiming:
        """The GPUs' part of a step through the pipeline stages (host time aside):
        its seconds, each stage's busy seconds, each boundary's hand-over seconds
        and the bubble (:class:`~.pipeline.PipelineTiming`). ``microbatches``:
        how many the step's sequences are cut into (default ``min(pp, sequences)``,
        the engine's); ``schedule``: ``"steady"`` (the engine's: vLLM's virtual
        engines, the period) or ``"gpipe"`` (fill and drain once). With
        ``pp`` = 1 it is one stage, no hand-over."""
        if not shapes:
            raise ValueError("shapes must name at least one sequence (new tokens, context)")
        return self._pipeline(shapes, logits_rows, microbatches, schedule)[0]


    def _moe_gpu_seconds(self, shapes, tokens: int, rows: int) -> dict[str, float]:
        """A mixture of experts' step on its busiest GPU: dense layers whole, MoE
        layers as attention plus :func:`~.moe.moe_layer_seconds`; under expert
        parallelism the sequences are dealt round-robin to the GPUs, and the one
        with the most new tokens (then the most context) sets the pace."""
        m, ep = self.model, self.ep
        local = max((shapes[r::ep] for r in range(ep)), key=lambda s: (sum(q for q, _ in s), sum(n for _, n in s)))
        local_tokens = sum(q for q, _ in local)
        dense, attn_side = self._layer_seconds(local_tokens), self._layer_seconds(local_tokens, dense_mlp=False)
        parts = {k: m.first_k_dense_layers * dense[k] + m.num_moe_layers * attn_side[k] for k in dense}
        parts["attention"] = m.num_layers * self.attention_seconds(local)
        moe = moe_layer_seconds(m, tokens, self.gpu, self.cal, self.tp, ep, self.load_imbalance, self.weight_elem)
        parts.update({k: m.num_moe_layers * v for k, v in moe.items()})
        parts.update(self._once_seconds(local_tokens, math.ceil(rows / ep)))
        return parts

    # --- the host's part ----------------------------------------------------------------
    def launch_seconds(self, shapes: list[tuple[int, int]]) -> float:
        """CPU time to launch the step's kernels (one graph replay for a decode-only
        step). With pipeline stages each GPU's host launches its own stage's kernels
        for each micro-batch, all at once; the busiest sets the time."""
        per_layer = KERNELS_PER_LAYER + (2 if self.tp > 1 else 0)
        if self.pp > 1:
            m = min(self.pp, len(shapes))
            if self.cuda_graphs and all(q == 1 for q, _ in shapes):
                return m * self.cal.graph_launch_s
            ends = [1 if s == 0 else KERNELS_PER_STEP if s == self.pp - 1 else 0 for s in range(self.pp)]
            return max(m * (per_layer * n + e + 1) for n, e in zip(self.stage_layers, ends)) * self.cal.launch_s
        if self.cuda_graphs and all(q == 1 for q, _ in shapes):
            return self.cal.graph_launch_s
        m = self.model
        if not m.is_moe:
            return (per_layer * m.num_layers + KERNELS_PER_STEP) * self.cal.launch_s
        # a MoE layer's MLP: its own kernels (3 more per shared-expert MLP, 2 all-to-alls under EP)
        moe = per_layer - 3 + MOE_KERNELS + (3 if m.num_shared_experts else 0) + (2 if self.ep > 1 else 0)
        kernels = per_layer * m.first_k_dense_layers + moe * m.num_moe_layers + KERNELS_PER_STEP
        return kernels * self.cal.launch_s

    # --- the step -----------------------------------------------------------------------
    def _timed(self, shapes, logits_rows) -> tuple[dict[str, float], float]:
        """The step's GPU seconds by part, with the host's unhidden share added, and its seconds."""
        if self.pp > 1:
            timing, parts = self._pipeline(shapes, logits_rows)
            gpu = timing.seconds
        else:
            parts = self.gpu_seconds(shapes, logits_rows)
            gpu = sum(parts.values())
        launch, host = self.launch_seconds(shapes), self.step_overhead_s
        seconds = max(gpu, host + launch) if self.async_scheduling else host + max(gpu, launch)
        parts["host (not hidden by the GPU)"] = seconds - gpu
        return parts, seconds

    def step_cost(self, shapes: list[tuple[int, int]], logits_rows: int | None = None) -> StepCost:
        """Cost of one step over sequences given as (new tokens q, context after the
        step n); ``logits_rows``: rows of the LM head (default one per sequence)."""
        parts, seconds = self._timed(shapes, logits_rows)
        flops, nbytes = self.roofline.flops_and_bytes(shapes, logits_rows)
        bound = "compute" if flops / self.gpu.peak_flops >= nbytes / self.gpu.hbm_bandwidth else "memory"
        return StepCost(flops, nbytes, seconds, bound, parts)

    def swap_time(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` of KV cache between host and device (the GPUs'
        links in parallel under tensor and pipeline parallelism), not overlapped with compute."""
        return nbytes / (self.gpu.host_link_bandwidth * self.tp * self.pp)

    def step_time(self, shapes: list[tuple[int, int]], swap_bytes: int = 0,
                  logits_rows: int | None = None) -> float:
        # the engine's clock, every step: the seconds alone (no FLOP and byte count)
        return (self._timed(shapes, logits_rows)[1] if shapes else 0.0) + self.swap_time(swap_bytes)

    def draft_time(self, steps: list[list[tuple[int, int]]]) -> float:
        """Seconds for a draft model's forwards (a cost model built for the draft's
        shape, with ``step_overhead_s=0``), each forward given as its sequences'
        (new tokens, context) shapes."""
        return sum(self._timed(shapes, None)[1] for shapes in steps if shapes)

    def __repr__(self) -> str:
        tp = (f" x{self.tp}" if self.tp > 1 else "") + (f", {self.pp} stages" if self.pp > 1 else "")
        tp += f" EP{self.ep}" if self.ep > 1 else ""
        dtypes = "".join(f", {k} {v}" for k, v in (("KV", self.kv_cache_dtype), ("weights", self.weight_dtype))
                         if v != "auto")
        return (f"CostModel({self.model.name} on {self.gpu.name}{tp}, host {self.step_overhead_s * 1e3:g} ms/step"
                f"{dtypes})")
