"""The sampler: a batch's next tokens, drawn with each row's
:class:`~minibatch_engine.sampling.params.SamplingParams`.

Greedy rows of a batch are one ``argmax``. The sampled rows' distributions
(temperature, top-k, top-p, softmax) are computed for all of them at once, a
few operators for the whole batch whatever its size (vLLM V1's sampler works on
the batch the same way; a loop of them per row cost a quarter of a 64-request
step on a CPU, chapter 10). The draws: a seeded row draws from its request's
own ``torch.Generator`` (seeded from ``SamplingParams.seed``), so a seeded
request draws the same tokens whatever it was batched with; the unseeded rows
draw together, from torch's global generator.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .params import SamplingParams


PREFIX = 64                   # top-p looks for its nucleus among this many tokens first


def filter_logits(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """Mask logits outside the top-k and the top-p nucleus with -inf (a new tensor).

    ``logits``: one row ``[vocab]`` or a batch ``[S, vocab]``; ``top_k`` and
    ``top_p``: one value for every row, or one per row (top_k 0: no top-k;
    top_p 1: no top-p). The result depends on the row alone, never on its
    batch mates (see :func:`_filter_` for how, with few passes over the
    vocabulary).

    **The tie rule: equal values are kept or dropped together.** Top-k keeps
    every token whose logit is at least the k-th largest (ties with the k-th
    stay, so a row may keep more than k). Top-p then works on what top-k kept,
    renormalised: a token stays when the tokens *strictly more likely* than it
    hold less than ``top_p`` of that mass. So the token that crosses ``top_p``
    stays, and so does every token tied with it, and the most likely tokens
    always stay, however small ``top_p`` is (a ``top_p`` that rounds to 0 would
    otherwise mask every token). vLLM's PyTorch sampler keeps top-k's ties the
    same way, but cuts top-p at a position of its sort, so tokens tied at the
    nucleus's edge are split by the sort's order; its FlashInfer kernels sample
    by rejection and match only in distribution. Ties are common: logits
    rounded to bfloat16 have 8 bits of mantissa."""
    one_row = logits.dim() == 1
    x = (logits[None] if one_row else logits).clone()
    rows = x.shape[0]
    ks = [top_k] * rows if isinstance(top_k, int) else list(top_k)
    ps = [float(top_p)] * rows if isinstance(top_p, (int, float)) else [float(p) for p in top_p]
    _filter_(x, ks, ps)
    return x[0] if one_row else x


def _put_rows(x: torch.Tensor, rows: torch.Tensor, order: torch.Tensor, values: torch.Tensor) -> None:
    """``x[rows[i], order[i, j]] = values[i, j]``, in place, touching only those entries."""
    flat = (rows[:, None] * x.shape[1] + order).reshape(-1)
    x.view(-1)[flat] = values.reshape(-1)


def _nucleus(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Which tokens of rows sorted by probability (float64, largest first,
    ``[S, W]``) are in the top-p nucleus: those whose strictly more likely tokens hold
    less than ``p`` (``[S, 1]``, float64). Tied tokens are contiguous and get
    the mass before their group's first member, so they go together. The
    cumulative mass is summed in float64, in order: on a CPU the first W sums
    are the same bits whatever the width (the prefix or the whole row)."""
    before = torch.nn.functional.pad(probs.cumsum(-1)[:, :-1], (1, 0))     # the mass of earlier positions
    start = torch.ones_like(probs, dtype=torch.bool)
    start[:, 1:] = probs[:, 1:] != probs[:, :-1]                         # the first of a group of ties
    strict = torch.where(start, before, torch.zeros_like(before)).cummax(-1).values
    return strict < p


def _filter_(x: torch.Tensor, ks: list[int], ps: list[float]) -> None:
    """:func:`filter_logits` in place on ``x`` ``[S, vocab]`` (contiguous).

    Rows are not sorted whole where it can be helped (sorting a row of 32,000
    logits takes a CPU milliseconds). Top-k is one ``topk`` for the k-th value
    and one mask. Top-p takes the softmax of the whole row (top-k's survivors
    renormalised) and looks for the nucleus among the row's W largest, W the
    larger of :data:`PREFIX` and the most tokens a top-k row kept (ties
    included): a row whose prefix ends inside its nucleus, with tokens left
    beyond it, is sorted whole. Each sorted position gets the same
    probability and cumulative mass whichever way it was found (tied tokens
    have equal probabilities, so the order among them does not matter), so a
    row's result does not depend on W, hence not on its batch mates."""
    rows, vocab = x.shape
    ks = [k if 0 < k < vocab else 0 for k in ks]
    counts = None                                       # tokens each row has left after top-k
    if any(ks):
        k = torch.tensor(ks, device=x.device)
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None]).masked_fill_((k == 0)[:, None], float("-inf"))
        below = x < kth                                 # ties with the k-th stay
        x.masked_fill_(below, float("-inf"))
        counts = vocab - below.sum(-1)
    if not any(p < 1.0 for p in ps):
        return
    p = torch.tensor(ps, device=x.device, dtype=torch.float64)[:, None]
    probs = torch.softmax(x, dim=-1, dtype=torch.float64)    # what top-p cuts: top-k's survivors, renormalised
    widest = max((int(c) for c, kk in zip(counts.tolist(), ks) if kk) if counts is not None else [0], default=0)
    width = min(vocab, max(PREFIX, widest))
    top, order = torch.topk(x, width, dim=-1)
    keep = _nucleus(probs.gather(1, order), p)
    left = counts > width if counts is not None else torch.full((rows,), vocab > width, device=x.device)
    nucleus = p[:, 0] < 1.0
    wide = nucleus & left & keep[:, -1]                 # the nucleus may reach past the prefix
    inside = (nucleus & ~wide).nonzero()[:, 0]
    if len(inside):                                     # the nucleus is in the prefix: the rest goes
        kept = top[inside].masked_fill_(~keep[inside], float("-inf"))
        x.index_fill_(0, inside, float("-inf"))
        _put_rows(x, inside, order[inside], kept)
    wide = wide.nonzero()[:, 0]
    if len(wide):                                       # those rows sorted whole
        ranked, order = torch.sort(x[wide], dim=-1, descending=True)
        keep = _nucleus(probs[wide].gather(1, order), p[wide])
        _put_rows(x, wide, order, ranked.masked_fill_(~keep, float("-inf")))


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distributions sampled (non-greedy) rows draw from: temperature, then
    top-k and top-p, then softmax. ``logits``: ``[S, vocab]``, one row per
    ``params``; the whole batch in a few operators."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} sampling parameters")
    # One tensor division whatever the temperatures (a division by a Python
    # number may round differently, and a row must not depend on its batch).
    temperatures = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
    x = logits.float() / temperatures
    top_k, top_p = [p.top_k for p in params], [p.top_p for p in params]
    if any(top_k) or min(top_p) < 1.0:
        x = x.contiguous()                  # the division's own tensor: filtered in place
        _filter_(x, top_k, top_p)
    return torch.softmax(x, dim=-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None],
           errors: dict[int, str] | None = None) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``[S, vocab]``; returns ``[S]`` (on device).

    A sampled row draws by inverting its cumulative distribution at a uniform
    number in [0, 1): one number from the row's generator (seeded rows) or from
    torch's global one, then one ``searchsorted`` for the batch. (The number,
    at most 1 - 2**-24, times the row's total rounds below the total, so the
    token found always has a probability above zero.)

    With ``errors`` (a dict), a row whose probabilities are not a distribution
    (say, NaN from non-finite logits) is recorded there, row -> message,
    instead of raising, so one request's failure does not end the others'."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    every_row = len(rows) == logits.shape[0]
    tokens = None if every_row else torch.argmax(logits, dim=-1)
    if not rows:
        return tokens
    cdf = sampling_probs(logits if every_row else logits[rows], [params[i] for i in rows]).cumsum_(-1)
    total = cdf[:, -1]
    valid = (torch.isfinite(total) & (total > 0)).tolist()      # NaN and inf reach the total
    uniforms, unseeded = [], []
    for j, row in enumerate(rows):
        gen = generators[row]
        if not valid[j]:
            message = "sampling failed: its probabilities are not finite (non-finite logits?)"
            if errors is None:
                raise RuntimeError(message)
            errors[row] = message
            uniforms.append(None)
            unseeded.append(j)          # drawn like the others; the token is not used
        elif gen is None:
            uniforms.append(None)
            unseeded.append(j)
        else:
            uniforms.append(torch.rand(1, generator=gen, device=gen.device))
    if unseeded:                        # one call for all of them
        fresh = torch.rand(len(unseeded), device=logits.device)
        if len(unseeded) == len(rows):
            uniforms = [fresh]
        else:
            for n, j in enumerate(unseeded):
                uniforms[j] = fresh[n:n + 1]
    u = uniforms[0] if len(uniforms) == 1 else torch.cat(uniforms)
    drawn = torch.searchsorted(cdf, (u.to(cdf.device, cdf.dtype) * total)[:, None], right=True)[:, 0]
    if every_row:
        return drawn
    tokens[torch.tensor(rows, device=logits.device)] = drawn
    return tokens
