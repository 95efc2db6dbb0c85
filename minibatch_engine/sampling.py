"""Sampling parameters and the sampler.

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

import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


GREEDY_EPS = 1e-5
PREFIX = 64                   # top-p looks for its nucleus among this many tokens first
MAX_SEED = 2**64 - 1          # a torch.Generator takes seeds in [0, 2**64)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (shaped like vLLM's).

    ``temperature=0`` (or anything below ``1e-5``) means greedy. ``top_k=0`` and ``top_p=1`` switch those
    filters off. ``max_tokens`` caps the output; ``stop_token_ids`` and the
    model's EOS end it early unless ``ignore_eos`` (serving benchmarks set it so
    output lengths follow the workload). ``seed`` makes sampling reproducible per
    request. ``n > 1`` draws n samples of one prompt: the prompt is prefilled once
    and the sequence forked, sample k seeded with ``seed + k`` (paged cache only).
    ``stop``: strings that end the output where they first appear, left out of
    its text (vLLM's ``stop``); text is checked after detokenising, by the front
    door (``LLM``, ``AsyncLLM``), as vLLM checks it outside its engine core.

    The rest are vLLM's, with vLLM's meaning, applied inside the batched sampler
    (:mod:`minibatch_engine.logits_process`): ``presence_penalty``,
    ``frequency_penalty``, ``repetition_penalty``, ``min_p``, ``min_tokens``,
    ``logit_bias`` (token id -> bias, stored as sorted pairs), ``bad_words``
    (strings, turned into ``bad_words_token_ids`` by the front door's
    tokenizer), ``include_stop_str_in_output``, ``truncate_prompt_tokens``
    (keep the prompt's last k tokens; -1: as many as fit), and
    log-probabilities (:mod:`minibatch_engine.logprobs`): ``logprobs=N`` returns
    each sampled token's log-probability and the N most likely tokens',
    ``prompt_logprobs=N`` the same for every prompt token; both from the raw
    model distribution (vLLM V1's default ``logprobs_mode``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    stop: str | Sequence[str] = field(default_factory=tuple)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: Any = None
    bad_words: Sequence[str] = field(default_factory=tuple)
    bad_words_token_ids: Sequence[Sequence[int]] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        def integer(name, low, high=None):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
                within = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise ValueError(f"SamplingParams.{name} must be an integer {within}, got {v!r}")

        def number(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise ValueError(f"SamplingParams.{name} must be a number, got {v!r}")

        integer("n", 1)
        integer("max_tokens", 1)
        integer("top_k", 0)
        number("temperature")
        number("top_p")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"SamplingParams.temperature must be >= 0 and finite, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:     # sample k of n > 1 draws with seed + k
            integer("seed", 0, MAX_SEED - (self.n - 1))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos must be True or False, got {self.ignore_eos!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, (list, tuple, set)):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids, got "
                             f"{self.stop_token_ids!r} (write [5] for one)")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative integers, "
                             f"got {self.stop_token_ids!r}")
        # numpy integers are taken, as in prompts; stored as a tuple of ints
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"SamplingParams.stop must be a string or a list of non-empty strings, "
                             f"got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        from .logits_process import check_params
        check_params(self)

    def max_proposals(self, num_output_tokens: int) -> int:
        """Proposed tokens worth verifying after ``num_output_tokens`` outputs
        (speculative decoding, chapter 9): k proposals yield up to k + 1 tokens,
        which must not run past ``max_tokens``."""
        return max(0, self.max_tokens - num_output_tokens - 1)

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_EPS`` are greedy (dividing logits by such a
        temperature overflows; vLLM draws the same line)."""
        return self.temperature < GREEDY_EPS


def filter_logits(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """Mask logits outside the top-k and the top-p nucleus with -inf (a new tensor).

    ``logits``: one row ``[vocab]`` or a batch ``[S, vocab]``; ``top_k`` and
    ``top_p``: one value for every row, or one per row (top_k 0: no top-k;
    top_p 1: no top-p). Ties with the k-th logit stay. The most likely token
    always stays, however small ``top_p`` is (a ``top_p`` that rounds to 0 in
    the logits' dtype would otherwise mask every token).

    Rows are not sorted whole where it can be helped (sorting a row of 32,000
    logits takes a CPU milliseconds): top-k takes the k largest, and top-p
    looks for its nucleus among the :data:`PREFIX` largest logits (or the top-k
    ones); a token outside a prefix that holds ``top_p`` of the probability is
    outside the nucleus. Only the rows whose nucleus is wider than the prefix
    are sorted whole. The result is the full sort's (to float rounding at the
    nucleus's edge, in the rows that did not need one)."""
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


def _filter_(x: torch.Tensor, ks: list[int], ps: list[float]) -> None:
    """:func:`filter_logits` in place on ``x`` ``[S, vocab]`` (contiguous), with a
    few passes over the whole vocabulary: the rest works on the prefixes."""
    rows, vocab = x.shape
    ks = [k if 0 < k < vocab else 0 for k in ks]
    top = order = None                                  # the largest logits, largest first
    if any(ks):
        k = torch.tensor(ks, device=x.device)
        top, order = torch.topk(x, max(ks), dim=-1)
        kth = top.gather(1, (k - 1).clamp(min=0)[:, None]).masked_fill_((k == 0)[:, None], float("-inf"))
        x.masked_fill_(x < kth, float("-inf"))
        top.masked_fill_(top < kth, float("-inf"))
    if not any(p < 1.0 for p in ps):
        return
    p = torch.tensor(ps, device=x.device, dtype=x.dtype)[:, None]
    if top is None:                                     # no top-k: the first few dozen
        top, order = torch.topk(x, min(vocab, PREFIX), dim=-1)
    if all(ks):                                         # the top-k prefix holds every token left
        probs = torch.softmax(top, dim=-1)
    else:
        probs = torch.softmax(x, dim=-1).gather(1, order)
    before = probs.cumsum(-1) - probs                   # the mass of the larger tokens
    drop = (before >= p) & (p < 1.0)                    # keep the token that crosses p
    drop[:, 0] = False
    every = torch.arange(rows, device=x.device)
    if all(ks):                                         # outside the prefix all is -inf already
        _put_rows(x, every, order, top.masked_fill_(drop, float("-inf")))
        return
    nucleus = p[:, 0] < 1.0
    short = nucleus & (before[:, -1] + probs[:, -1] < p[:, 0])   # a nucleus wider than the prefix
    inside = (nucleus & ~short).nonzero()[:, 0]
    if len(inside):                                     # the nucleus is in the prefix: the rest goes
        kept = top[inside].masked_fill_(drop[inside], float("-inf"))
        x.index_fill_(0, inside, float("-inf"))
        _put_rows(x, inside, order[inside], kept)
    wide = short.nonzero()[:, 0]
    if len(wide):                                       # those rows sorted whole
        ranked, order = torch.sort(x[wide], dim=-1, descending=True)
        probs = torch.softmax(ranked, dim=-1)
        drop = probs.cumsum(-1) - probs >= p[wide]
        drop[:, 0] = False
        _put_rows(x, wide, order, ranked.masked_fill_(drop, float("-inf")))


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distributions sampled (non-greedy) rows draw from: temperature, then
    top-k and top-p, then softmax. ``logits``: ``[S, vocab]``, one row per
    ``params``; the whole batch in a few operators."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} sampling parameters")
    temperatures = [p.temperature for p in params]
    if len(set(temperatures)) == 1:
        x = logits.float() / temperatures[0]
    else:
        x = logits.float() / torch.tensor(temperatures, device=logits.device)[:, None]
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
