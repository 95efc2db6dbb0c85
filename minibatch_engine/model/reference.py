"""Ground truth for the correctness rule: greedy decoding by full recompute.

With a quantized KV cache (``kv_cache_dtype="fp8"`` or ``"int8"``) the ground
truth is a full recompute *through the same quantized cache*: every step
writes the whole sequence's K/V into a fresh one-sequence pool (quantized on
write, exactly as the engine's forward does) and attends by reading them back.
Each token's stored bytes depend on that token alone (scales per token and
head), so this is what every scheduling mode of an engine with that cache must
reproduce.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..attention import AttentionMetadata
from ..kv.pool import KVPool


@torch.no_grad()
def full_forward_logits(model, token_ids: Sequence[int], kv_cache_dtype: str = "auto",
                        kv_cache_scale: str = "per_token_head",
                        static_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[len, vocab]`` of every position of one sequence: no cache
    (``kv_cache_dtype="auto"``), or attention over its own K/V stored in a
    quantized pool (``"fp8"``, ``"int8"``; scales as :class:`~minibatch_engine.kv.KVPool`)."""
    n = len(token_ids)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    pos = torch.arange(n, device=model.device)
    if kv_cache_dtype == "auto":
        meta = AttentionMetadata.build([n], [n], device=model.device)
        return model(ids, pos, meta, kv_pool=None, all_logits=True)
    cfg = model.config
    pool = KVPool(cfg.num_layers, 1, n, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device,
                  kv_cache_dtype, kv_cache_scale, static_scales)
    meta = AttentionMetadata.build([n], [n], [[0]], n, device=model.device)
    return model(ids, pos, meta, kv_pool=pool, all_logits=True)


@torch.no_grad()
def reference_generate(model, prompt_ids: Sequence[int], max_new_tokens: int,
                       kv_cache_dtype: str = "auto") -> list[int]:
    """Greedy token ids, recomputing the whole sequence at every step (no KV
    cache; with ``kv_cache_dtype`` "fp8" or "int8", through that quantized
    cache: see the module).

    Plain argmax; EOS is not special. Slow on purpose: O(n^2) work per token.
    This is what every scheduling mode of the engine must reproduce exactly.
    """
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must not be empty")
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    seq = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = full_forward_logits(model, seq, kv_cache_dtype)[-1]
        tok = int(torch.argmax(logits))
        out.append(tok)
        seq.append(tok)
    return out
