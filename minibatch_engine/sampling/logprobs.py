"""Log-probabilities of sampled and prompt tokens (``SamplingParams.logprobs``,
``prompt_logprobs``).

Which distribution: the raw model's, ``log_softmax`` of the logits as the
model computed them, before penalties, bias, temperature, ``min_p``, top-k and
top-p. That is vLLM V1's default (``logprobs_mode="raw_logprobs"``), and what
an evaluation harness wants: the model's likelihood of a text, not the
sampler's. (A token can then be sampled that top-k would never show among the
top-N: its own log-probability is always returned.)

One entry per token, ``(token_ids, logprobs, rank)``: the token first, then
the N most likely tokens, largest first, with their log-probabilities; ``rank``
is the token's place in the vocabulary by probability (1: the most likely).
Plain lists, so a :class:`~minibatch_engine.core.outputs.RunnerOutput` stays plain
data. :func:`as_dicts` turns entries into vLLM's shape, ``{token_id: Logprob}``.

Prompt log-probabilities need the logits of every prompt position, not only
the last one a prefill samples from: the runner asks the model for those rows
(``logits_indices``). Position p's row scores token p + 1, so under chunked
prefill the last row of a chunk scores the first token of the next chunk; the
runner keeps that row until the next chunk arrives. A prompt found in the
prefix cache is never computed and has no logits, so a request that asks for
prompt log-probabilities skips the prefix-cache lookup (as vLLM V1 does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Entry = tuple  # (token_ids: list[int], logprobs: list[float], rank: int)


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``): ``rank`` 1 is the most
    likely token; ``decoded_token`` its text (None without a tokenizer)."""
    logprob: float
    rank: int
    decoded_token: str | None = None


def wide(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32 at least (vLLM's precision; a float64 model keeps float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int],
                   normalised: bool = False) -> list[Entry]:
    """One entry per row of ``logits`` ``[R, vocab]``: row i's log-probability of
    ``token_ids[i]``, its rank, and its ``num_top[i]`` most likely tokens. One
    ``log_softmax``, one ``gather`` and one ``topk`` for all rows; one copy to the
    host. ``normalised``: the rows are log-probabilities already."""
    if not len(token_ids):
        return []
    lp = logits if normalised else torch.log_softmax(wide(logits), dim=-1)
    tok = torch.tensor(list(token_ids), device=lp.device)[:, None]
    chosen = lp.gather(1, tok)
    rank = (lp > chosen).sum(dim=-1) + 1
    k = min(max(num_top), lp.shape[1])
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], tok[:, :0])
    chosen, rank = chosen[:, 0].tolist(), rank.tolist()
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [([t] + top_ids[i][:n], [chosen[i]] + top_lp[i][:n], rank[i])
            for i, (t, n) in enumerate(zip(token_ids, num_top))]


def as_dicts(entries, decode=None) -> list:
    """Entries as vLLM's ``list[dict[int, Logprob]]`` (None stays None: the
    first prompt token has no log-probability). The token's own entry holds its
    rank; the top tokens' ranks are their places (1, 2, ...)."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ids, lps, rank = e
        d = {ids[0]: Logprob(lps[0], rank, None if decode is None else decode([ids[0]]))}
        for j, (t, v) in enumerate(zip(ids[1:], lps[1:])):
            if t not in d:
                d[t] = Logprob(v, j + 1, None if decode is None else decode([t]))
        out.append(d)
    return out
