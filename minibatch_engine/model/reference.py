"""Ground truth for the correctness rule: greedy decoding by full recompute."""
from __future__ import annotations

from typing import Sequence

import torch

from ..attention import AttentionMetadata


@torch.no_grad()
def full_forward_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits ``[len, vocab]`` of every position of one sequence, with no cache."""
    n = len(token_ids)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    pos = torch.arange(n, device=model.device)
    meta = AttentionMetadata.build([n], [n], device=model.device)
    return model(ids, pos, meta, kv_pool=None, all_logits=True)


@torch.no_grad()
def reference_generate(model, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy token ids, recomputing the whole sequence at every step (no KV cache).

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
        logits = full_forward_logits(model, seq)[-1]
        tok = int(torch.argmax(logits))
        out.append(tok)
        seq.append(tok)
    return out
