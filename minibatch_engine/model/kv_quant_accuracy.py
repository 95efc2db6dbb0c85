"""What a quantized KV cache costs in accuracy, measured (chapter 13).

For one model and a held-out token sequence, each KV format (``"fp8"``,
``"int8"``) and scale granularity (``"per_token_head"``, ``"per_head"``,
``"per_tensor"``) is compared with the same model over an unquantized cache:

* **teacher-forced** on the text (:func:`teacher_forced_metrics`): the KL
  divergence ``KL(p_float || p_quant)`` of each position's next-token
  distribution (mean and max, nats), the error of the log-probability of the
  true next token, top-1 agreement, and the perplexity of both;
* **greedy generation** (:func:`greedy_agreement`): long greedy continuations
  of several prompts, token for token against the float cache's, with the
  position of the first differing token;
* **where and why** (:func:`kv_error_profile`): each layer's K and V round-trip
  error under each granularity, and how far a row's largest value sits above
  its RMS (the outliers that set a scale and leave the other values coarse).

Static scales (``per_head``, ``per_tensor``) are calibrated on *other* text
(:func:`calibrate_kv_scales`) than the text measured. Everything here is
deterministic on a CPU (no sampling, no timing).
"""
from __future__ import annotations

import math
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..attention import AttentionMetadata, get_attention_backend
from ..kv.pool import KVPool
from ..kv.quant import SCALE_GRANULARITIES, dequantize, kv_format, quantize
from .reference import full_forward_logits

VARIANTS = [("auto", "per_token_head")] + [(d, g) for d in ("fp8", "int8") for g in SCALE_GRANULARITIES]


def held_out_python_text(name: str = "json/decoder.py") -> str:
    """A standard-library file from a sub-package: Python source that ``tiny-py``
    was not trained on (its corpus is the top-level modules only; see
    ``tools/train_tiny.py``)."""
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()


@torch.no_grad()
def capture_kv(model, token_ids: Sequence[int]) -> torch.Tensor:
    """K and V of every layer for one sequence, as the cache would hold them
    unquantized (keys after RoPE): ``[layers, 2, tokens, kv_heads, head_dim]``."""
    n, cfg = len(token_ids), model.config
    pool = KVPool(cfg.num_layers, 1, n, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device)
    ids = torch.tensor(list(token_ids), device=model.device)
    model(ids, torch.arange(n, device=model.device), AttentionMetadata.build([n], [n], [[0]], n), pool)
    return pool.kv[:, :, 0].clone()


def calibrate_kv_scales(model, token_ids: Sequence[int], kv_cache_dtype: str, granularity: str) -> torch.Tensor:
    """Static scales ``[layers, 2, kv_heads]`` for ``granularity`` "per_head" (each
    head's largest |K| or |V| over the calibration text / qmax) or "per_tensor"
    (the layer's largest, for every head), as vLLM's calibrated ``k_scale``,
    ``v_scale``."""
    fmt = kv_format(kv_cache_dtype)
    if granularity not in ("per_head", "per_tensor"):
        raise ValueError(f"granularity must be 'per_head' or 'per_tensor' for static scales, got {granularity!r}")
    amax = capture_kv(model, token_ids).abs().amax(dim=(2, 4)).float()         # [layers, 2, kv_heads]
    if granularity == "per_tensor":
        amax = amax.amax(dim=-1, keepdim=True).expand_as(amax)
    return (amax / fmt.qmax).clamp_min(torch.finfo(torch.float32).tiny).contiguous()


def _scales(model, calibration_ids, kv, granularity):
    if kv == "auto" or granularity == "per_token_head":
        return None
    return calibrate_kv_scales(model, calibration_ids, kv, granularity)


@dataclass
class TeacherForced:
    kv_cache_dtype: str
    scale: str
    mean_kl: float            # nats per position, KL(p_float || p_quant)
    max_kl: float
    mean_logprob_error: float  # |log p_quant(true next) - log p_float(true next)|
    top1_agreement: float      # share of positions whose argmax is the float cache's
    perplexity: float
    float_perplexity: float


@torch.no_grad()
def teacher_forced_metrics(model, token_ids: Sequence[int], calibration_ids: Sequence[int],
                           variants=VARIANTS) -> list[TeacherForced]:
    """The teacher-forced comparison above, one row per (format, granularity)."""
    ids = list(token_ids)
    target = torch.tensor(ids[1:], device=model.device)
    base = torch.log_softmax(full_forward_logits(model, ids)[:-1].double(), dim=-1)
    base_nll = -base.gather(1, target[:, None]).squeeze(1)
    rows = []
    for kv, gran in variants:
        logits = full_forward_logits(model, ids, kv, gran, _scales(model, calibration_ids, kv, gran))
        lp = torch.log_softmax(logits[:-1].double(), dim=-1)
        kl = (base.exp() * (base - lp)).sum(-1)
        nll = -lp.gather(1, target[:, None]).squeeze(1)
        rows.append(TeacherForced(kv, gran, float(kl.mean()), float(kl.max()),
                                  float((nll - base_nll).abs().mean()),
                                  float((lp.argmax(-1) == base.argmax(-1)).double().mean()),
                                  math.exp(float(nll.mean())), math.exp(float(base_nll.mean()))))
    return rows


@torch.no_grad()
def greedy_tokens(model, prompt: Sequence[int], max_new_tokens: int, kv_cache_dtype: str = "auto",
                  scale: str = "per_token_head", static_scales: torch.Tensor | None = None,
                  backend: str = "sdpa", return_margins: bool = False):
    """Greedy tokens through a one-sequence cache of ``kv_cache_dtype`` (prefill,
    then one decode step per token: the engine's own write and read path). With
    ``return_margins``: also the top-1 minus top-2 logit at each step."""
    cfg, dev = model.config, model.device
    n = len(prompt) + max_new_tokens
    pool = KVPool(cfg.num_layers, 1, n, cfg.num_kv_heads, cfg.head_dim, model.dtype, dev, kv_cache_dtype,
                  scale, static_scales)
    attn = get_attention_backend(backend, dev)
    seq, out, margins = list(prompt), [], []
    start, new = 0, list(prompt)
    for _ in range(max_new_tokens):
        meta = attn.build_metadata([len(new)], [start + len(new)], [[0]], n, device=dev)
        logits = model(torch.tensor(new, device=dev), torch.arange(start, start + len(new), device=dev),
                       meta, pool)[-1]
        top2 = torch.topk(logits.double(), 2).values
        margins.append(float(top2[0] - top2[1]))
        tok = int(torch.argmax(logits))
        out.append(tok)
        start, new = len(seq), [tok]
        seq.append(tok)
    return (out, margins) if return_margins else out


@dataclass
class GreedyAgreement:
    kv_cache_dtype: str
    scale: str
    token_agreement: float       # share of generated tokens equal to the float cache's, position by position
    identical_runs: int          # prompts whose whole continuation is the float cache's
    num_runs: int
    mean_first_divergence: float  # tokens before the first difference (max_new_tokens when none)
    divergence_margins: list     # the float cache's top-1 minus top-2 logit where each run first differs
    median_margin: float         # the same margin at every step of the float runs, median


@torch.no_grad()
def greedy_agreement(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     calibration_ids: Sequence[int], variants=VARIANTS) -> list[GreedyAgreement]:
    """Long greedy continuations of each prompt, quantized cache against float cache."""
    base = [greedy_tokens(model, p, max_new_tokens, return_margins=True) for p in prompts]
    all_margins = torch.tensor([m for _, ms in base for m in ms])
    rows = []
    for kv, gran in variants:
        scales = _scales(model, calibration_ids, kv, gran)
        equal = identical = 0
        firsts, at_div = [], []
        for p, (want, margins) in zip(prompts, base):
            got = greedy_tokens(model, p, max_new_tokens, kv, gran, scales)
            equal += sum(a == b for a, b in zip(got, want))
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), max_new_tokens)
            firsts.append(first)
            identical += first == max_new_tokens
            if first < max_new_tokens:
                at_div.append(round(margins[first], 4))
        rows.append(GreedyAgreement(kv, gran, equal / (len(prompts) * max_new_tokens), identical, len(prompts),
                                    sum(firsts) / len(firsts), at_div, float(all_margins.median())))
    return rows


@torch.no_grad()
def kv_error_profile(model, token_ids: Sequence[int], calibration_ids: Sequence[int],
                     kv_cache_dtype: str = "int8") -> list[dict]:
    """Per layer, for K and for V: the relative RMS round-trip error under each
    granularity; ``peak_to_rms``, the mean over (token, head) rows of max|x| /
    RMS(x) (how far the largest value, which sets a per-row scale, stands above
    the rest); and ``channel_peak_to_mean``, each head's loudest channel's RMS over
    the tokens / its channels' mean RMS, averaged over heads (channel outliers:
    a few dimensions large in every token, as keys have in large models)."""
    fmt = kv_format(kv_cache_dtype)
    kv = capture_kv(model, token_ids).double()                         # [L, 2, T, H, D]
    static = {g: calibrate_kv_scales(model, calibration_ids, kv_cache_dtype, g) for g in ("per_head", "per_tensor")}
    rows = []
    for layer in range(kv.shape[0]):
        for j, name in enumerate("KV"):
            x = kv[layer, j]
            chan = x.pow(2).mean(0).sqrt()                                     # [H, D]
            row = {"layer": layer, "kv": name,
                   "peak_to_rms": float((x.abs().amax(-1) / x.pow(2).mean(-1).sqrt().clamp_min(1e-30)).mean()),
                   "channel_peak_to_mean": float((chan.amax(-1) / chan.mean(-1)).mean())}
            for g in SCALE_GRANULARITIES:
                scale = None if g == "per_token_head" else static[g][layer, j]
                stored, s = quantize(x, fmt, scale)
                err = dequantize(stored, s, torch.float64) - x
                row[g] = float(err.pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
            rows.append(row)
    return rows


def as_rows(results) -> list[dict]:
    """Dataclass results as plain dicts (for tables and JSON)."""
    return [asdict(r) for r in results]
