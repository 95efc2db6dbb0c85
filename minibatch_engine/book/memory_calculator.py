"""Chapter 13's memory calculator: a model, an attention variant, a KV dtype, a
weight dtype, a context length and GPUs -> the largest batch that fits and a
decode step's time at that batch.

The arithmetic, per GPU of a ``num_gpus``-way tensor-parallel group:

* weights: the projections in ``weight_dtype`` and the embedding and LM head
  in bf16 (:mod:`minibatch_engine.sim.precision`), split over the GPUs;
* KV memory: ``gpu_memory_utilization`` of the GPU's memory less its weights;
* KV per token: :meth:`~minibatch_engine.sim.attention_variants.AttentionShape.kv_bytes_per_token`
  for the variant (heads split over the GPUs; an MLA latent on every GPU);
* max batch: KV memory // (context x KV per token);
* decode step: a roofline with the simulator's fitted efficiencies, the larger
  of the arithmetic (``2 x active parameters`` FLOPs per sequence) and the
  bytes (the weights once, every sequence's K and V once). No all-reduce, no
  host time: a sketch to compare settings, not :mod:`~minibatch_engine.sim.cost_model`.

``static/memory.js`` computes the same in the browser; a test runs both.
"""
from __future__ import annotations

from ..sim.attention_variants import ATTENTION_SHAPES, VARIANTS
from ..sim.calibration import default_calibration
from ..sim.hardware import GPUS, get_gpu
from ..sim.precision import ACTIVATION_BYTES, KV_CACHE_DTYPES, WEIGHT_DTYPES, kv_bytes_per_element, \
    weight_bytes_per_element
from .explorables.base import Explorable


def model_weight_bytes(shape, weight_dtype: str = "auto") -> float:
    """All weights: the embedding and LM head in bf16, the rest in ``weight_dtype``."""
    emb = shape.embedding_parameters
    return (shape.parameters - emb) * weight_bytes_per_element(weight_dtype) + emb * ACTIVATION_BYTES


def plan(model: str, variant: str | None = None, kv_cache_dtype: str = "auto", weight_dtype: str = "auto",
         context: int = 4096, gpu: str = "H100-SXM", num_gpus: int = 1,
         gpu_memory_utilization: float = 0.9) -> dict:
    """What fits and how fast a decode step runs (see the module's docstring).
    ``variant``: None for the model's own attention, or ``"MHA"``, ``"GQA"``,
    ``"MQA"``, ``"MLA"`` at the model's shape."""
    shape, g, cal = ATTENTION_SHAPES[model], get_gpu(gpu), default_calibration()
    weights = model_weight_bytes(shape, weight_dtype) / num_gpus
    kv_memory = gpu_memory_utilization * g.memory_bytes - weights
    per_token = shape.kv_bytes_per_token(kv_cache_dtype, variant, num_gpus)
    batch = max(0, int(kv_memory // (context * per_token)))
    active = shape.active_parameters or shape.parameters
    compute = 2 * active * batch / num_gpus / (g.peak_flops * cal.e_compute)
    memory = (weights / (g.hbm_bandwidth * cal.e_memory)
              + batch * context * per_token / (g.hbm_bandwidth * cal.attention_e_memory))
    step = max(compute, memory)
    return {"weights_gb": weights / 1e9, "kv_gb": max(kv_memory, 0.0) / 1e9,
            "kv_kib_per_token": per_token / 1024, "max_batch": batch,
            "step_ms": step * 1e3 if batch else None,
            "tokens_per_s": batch / step if batch else 0.0,
            "bound": "compute" if compute > memory else "memory"}


def memory_explorer(checks=(
        {"model": "Llama-3-8B"},
        {"model": "Llama-3-8B", "kv": "fp8", "context": 32768},
        {"model": "Llama-2-7B", "variant": "GQA", "weight": "int4"},
        {"model": "Falcon-7B", "variant": "MHA", "gpu": "A100-80GB"},
        {"model": "Llama-3-70B", "gpus": 4, "kv": "int8", "context": 131072},
        {"model": "DeepSeek-V3", "gpus": 8, "gpu": "H200", "weight": "fp8"},
        {"model": "DeepSeek-V3", "gpus": 8, "gpu": "H200", "weight": "fp8", "variant": "MHA"},
        {"model": "Llama-3-70B"})) -> Explorable:
    """The explorable: every control's options and the formulas' constants as
    data, and ``checks`` (settings; the rest at their defaults) at which the
    page must show :func:`plan`'s numbers."""
    contexts = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    cal = default_calibration()
    models = {name: {"variant": s.variant, "layers": s.num_layers, "heads": s.num_heads, "kv_heads": s.kv_heads,
                     "head_dim": s.head_dim, "v_dim": s.v_dim, "latent": s.latent_dim, "rope": s.rope_dim,
                     "parameters": s.parameters, "active": s.active_parameters or s.parameters,
                     "embedding": s.embedding_parameters}
              for name, s in ATTENTION_SHAPES.items()}
    gpus = {g.name: {"memory": g.memory_bytes, "bandwidth": g.hbm_bandwidth, "flops": g.peak_flops}
            for g in GPUS.values()}
    data = {"models": models, "gpus": gpus, "contexts": contexts, "variants": ["own", *VARIANTS],
            "kv_bytes": dict(KV_CACHE_DTYPES), "weight_bytes": dict(WEIGHT_DTYPES),
            "activation_bytes": ACTIVATION_BYTES, "utilization": 0.9,
            "e_compute": cal.e_compute, "e_memory": cal.e_memory, "e_attention": cal.attention_e_memory,
            "defaults": {"model": "Llama-3-8B", "variant": "own", "kv": "auto", "weight": "auto",
                         "context": contexts.index(4096), "gpu": "H100-SXM", "gpus": "1"}}
    expect = []
    for c in checks:
        s = {**data["defaults"], **{k: v for k, v in c.items() if k != "context"}}
        context = c.get("context", 4096)
        s["context"], s["gpus"] = contexts.index(context), str(s["gpus"])
        p = plan(s["model"], None if s["variant"] == "own" else s["variant"], s["kv"], s["weight"], context,
                 s["gpu"], int(s["gpus"]))
        out = {"max_batch": p["max_batch"], "kv_kib": p["kv_kib_per_token"], "weights_gb": p["weights_gb"]}
        if p["max_batch"]:
            out.update(step_ms=p["step_ms"], tokens_per_s=p["tokens_per_s"])
        expect.append({"set": s, "expect": out})
    return Explorable("ch13-memory", "memory", data, expect,
                      title="Memory calculator: what fits, and how fast it decodes")


__all__ = ["memory_explorer", "model_weight_bytes", "plan", "kv_bytes_per_element"]
