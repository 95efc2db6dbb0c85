"""Verifying proposed tokens: the target model decides, the proposer only guesses.

The target runs once over a decoding request's last token and its k proposals
``x_1 .. x_k``, which gives its next-token distribution after each prefix:
``p_0 .. p_k`` (k + 1 rows of logits from one forward).

* **Greedy**: accept proposals while each equals the target's argmax after the
  tokens before it; then append the target's own argmax at the first mismatch
  (or after all k, the "bonus" token). The output is exactly what greedy
  decoding one token at a time would give.
* **Sampling** (Leviathan et al. 2023; Chen et al. 2023): accept ``x_i`` with
  probability ``min(1, p_i(x_i) / q_i(x_i))``, where ``q_i`` is the distribution
  the proposer drew ``x_i`` from. At the first rejection draw a replacement from
  the residual ``max(0, p_i - q_i)``, renormalised, and stop; if all k are
  accepted, draw the bonus token from ``p_k``. Each emitted token is then
  distributed exactly as ``p`` would have sampled it: accepting gives
  ``min(p, q)``, the residual adds ``p - min(p, q)``.

A deterministic proposer (n-gram lookup, a greedy draft model) is a point mass:
``q_i(x_i) = 1``, so ``x_i`` is accepted with probability ``p_i(x_i)`` and the
residual is ``p_i`` with ``x_i`` removed.

Either way the result is the accepted prefix of the proposals plus one token
from the target: between 1 and k + 1 tokens per verification.
"""
from __future__ import annotations

from typing import Sequence

import torch


def verify_greedy(target_argmax: Sequence[int], proposals: Sequence[int]) -> list[int]:
    """``target_argmax``: the target's argmax after each prefix (k + 1 values)."""
    out = []
    for proposed, target in zip(proposals, target_argmax):
        out.append(int(target))
        if proposed != target:
            return out
    out.append(int(target_argmax[len(proposals)]))
    return out


def rejection_sample(target_probs: torch.Tensor, proposals: Sequence[int],
                     draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling. ``target_probs`` ``[k + 1, vocab]``: the target's
    distributions ``p_0 .. p_k``; ``draft_probs`` ``[k, vocab]``: the proposer's
    ``q_0 .. q_{k-1}`` (None: each proposal was a point mass). Returns the accepted
    proposals plus one token drawn from the target's (residual) distribution."""
    k = len(proposals)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{k} proposals need {k + 1} rows of target probabilities, got {target_probs.shape[0]}")
    dev = target_probs.device
    out: list[int] = []
    for i, x in enumerate(proposals):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = draft_probs[i].to(p)
        u = torch.rand((), generator=generator, device=dev)
        if u * q[x] < p[x]:                  # u < p(x) / q(x), without dividing by zero
            out.append(int(x))
            continue
        residual = torch.clamp(p - q, min=0)
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)[0]))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)[0]))
    return out
