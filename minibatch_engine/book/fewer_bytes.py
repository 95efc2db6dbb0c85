"""Chapter 13's runs: fewer bytes per token, measured.

* :func:`sim_kv_dtypes_under_load`: one workload at one KV byte budget on a
  simulated GPU, once per ``kv_cache_dtype`` (the CPU counterpart is
  :func:`minibatch_engine.book.kv_capacity.kv_dtypes_under_load`);
* :func:`sim_weight_dtypes`: a decode step's modelled time and the KV room
  left, per simulated weight dtype;
* :func:`compare_models`: a quantized model against its float original on
  held-out text, teacher-forced (KL, log-prob error, top-1 agreement,
  perplexity; the formulas of :mod:`minibatch_engine.model.kv_quant_accuracy`, here
  between two models instead of two caches);
* :func:`greedy_agreement_between`: long greedy continuations, token for token;
* :func:`decode_rates`: decode tokens per second of several models at several
  batch sizes, in alternating rounds (wall clock: for display only).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..harness.bench import run_bench
from ..core.engine import Engine
from ..model.kv_quant_accuracy import greedy_tokens
from ..model.reference import full_forward_logits
from ..sampling.params import SamplingParams
from ..sim import CostModel, get_gpu
from ..sim.precision import weight_bytes

SIM_KEYS = ("kv_cache_dtype", "kv_bytes_per_token", "kv_blocks", "peak_running", "preemptions",
            "recomputed_tokens", "steps", "sim_seconds", "sim_output_tokens_per_second", "tpot_ms_p99")


def sim_kv_dtypes_under_load(kv_budget_bytes: int, dtypes=("auto", "fp8", "int8"), sim_gpu: str = "H100-SXM",
                             sim_model: str = "llama-3-8b", workload: str = "chat", num_requests: int = 512,
                             max_batch: int = 256, seed: int = 0, **engine_options) -> list[dict]:
    """One row per KV dtype (the keys of :data:`SIM_KEYS`): the same requests,
    all arriving at time 0, at one KV byte budget, on the simulated GPU."""
    rows = []
    for kv in dtypes:
        s, _ = run_bench(workload=workload, num_requests=num_requests, max_batch=max_batch, seed=seed,
                         sim_gpu=sim_gpu, sim_model=sim_model, simulate_only=True, progress=False,
                         kv_budget_bytes=kv_budget_bytes, kv_cache_dtype=kv, **engine_options)
        rows.append({k: s[k] for k in SIM_KEYS})
    return rows


def sim_weight_dtypes(dtypes=("auto", "fp8", "int4"), sim_gpu: str = "H100-SXM", sim_model: str = "llama-3-8b",
                      batches=(1, 64), context: int = 1024, gpu_memory_utilization: float = 0.9) -> list[dict]:
    """Per weight dtype: the weights' GB, the GB left for KV on one GPU, and the
    modelled decode step (ms) at each batch with ``context`` tokens each."""
    gpu = get_gpu(sim_gpu)
    rows = []
    for w in dtypes:
        cm = CostModel(gpu, _preset(sim_model), weight_dtype=w)
        row = {"weight_dtype": w, "weights_gb": weight_bytes(cm.model, w) / 1e9,
               "kv_room_gb": (gpu_memory_utilization * gpu.memory_bytes - cm.weight_bytes) / 1e9}
        for b in batches:
            row[f"step_ms_b{b}"] = cm.step_time([(1, context)] * b) * 1e3
        rows.append(row)
    return rows


def _preset(name):
    from ..model.config import get_preset
    return get_preset(name)


@dataclass
class ModelComparison:
    name: str
    mean_kl: float              # nats per position, KL(p_base || p_model)
    max_kl: float
    mean_logprob_error: float   # |log p_model(true next) - log p_base(true next)|, mean
    top1_agreement: float       # positions whose argmax is the base model's
    perplexity: float
    base_perplexity: float


@torch.no_grad()
def compare_models(base, models: Mapping[str, object], token_ids: Sequence[int]) -> list[ModelComparison]:
    """Each of ``models`` against ``base``, teacher-forced on ``token_ids``
    (every position's next-token distribution; log-probabilities in float64)."""
    ids = list(token_ids)
    target = torch.tensor(ids[1:])
    ref = torch.log_softmax(full_forward_logits(base, ids)[:-1].double().cpu(), dim=-1)
    ref_nll = -ref.gather(1, target[:, None]).squeeze(1)
    rows = []
    for name, m in models.items():
        lp = torch.log_softmax(full_forward_logits(m, ids)[:-1].double().cpu(), dim=-1)
        kl = (ref.exp() * (ref - lp)).sum(-1)
        nll = -lp.gather(1, target[:, None]).squeeze(1)
        rows.append(ModelComparison(name, float(kl.mean()), float(kl.max()), float((nll - ref_nll).abs().mean()),
                                    float((lp.argmax(-1) == ref.argmax(-1)).double().mean()),
                                    math.exp(float(nll.mean())), math.exp(float(ref_nll.mean()))))
    return rows


def greedy_agreement_between(base, model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
    """Greedy continuations of each prompt by ``model`` against ``base``'s (both
    through the engine's cache path): the share of equal tokens position by
    position, the runs equal throughout, and the mean tokens before the first
    difference."""
    equal, identical, firsts = 0, 0, []
    for p in prompts:
        want, got = greedy_tokens(base, p, max_new_tokens), greedy_tokens(model, p, max_new_tokens)
        equal += sum(a == b for a, b in zip(got, want))
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), max_new_tokens)
        firsts.append(first)
        identical += first == max_new_tokens
    return {"token_agreement": equal / (len(prompts) * max_new_tokens), "identical_runs": identical,
            "num_runs": len(prompts), "mean_first_divergence": sum(firsts) / len(firsts)}


def _decode_rate(model, batch: int, prompt_len: int, new_tokens: int, backend: str) -> float:
    """Decode tokens per second of one run: ``batch`` requests, decode steps only."""
    eng = Engine(model, max_num_seqs=batch, attention_backend=backend, enable_prefix_caching=False)
    for i in range(batch):
        eng.add_request([(7 * i + j) % 250 for j in range(prompt_len)],
                        SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    eng.run()
    decode = [s for s in eng.trace.steps if s.prefill_tokens == 0]
    return sum(s.sampled_tokens for s in decode) / sum(s.wall_end - s.wall_start for s in decode)


def decode_rates(models: Mapping[str, object], batches=(1, 8, 64), rounds: int = 3, prompt_len: int = 16,
                 new_tokens: int = 9, backend: str = "sdpa", progress=None) -> dict:
    """``{(name, batch): median decode tok/s}`` over ``rounds`` rounds; in each
    round every model runs each batch once, one after another (alternating, so
    a busy spell on a shared machine hits every model alike). Wall clock."""
    rates: dict = {}
    _decode_rate(next(iter(models.values())), 1, prompt_len, 2, backend)     # warm-up
    for _ in range(rounds):
        for b in batches:
            for name, m in models.items():
                rates.setdefault((name, b), []).append(_decode_rate(m, b, prompt_len, new_tokens, backend))
                if progress is not None:
                    progress()
    return {k: statistics.median(v) for k, v in rates.items()}


def median_ratio(rates: Mapping, name: str, base: str, batch: int) -> float:
    """``rates[name, batch] / rates[base, batch]``."""
    return rates[name, batch] / rates[base, batch]


def timed(fn, *args, **kwargs):
    """``(result, seconds)`` of one call (wall clock)."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
