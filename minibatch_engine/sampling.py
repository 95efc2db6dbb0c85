"""Sampling parameters and the sampler.

Greedy rows of a batch are one ``argmax``; sampled rows each use their request's
own ``torch.Generator`` (seeded from ``SamplingParams.seed``), so a seeded
request draws the same tokens whatever it was batched with.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Sequence

import torch


GREEDY_EPS = 1e-5
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
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1

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


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits (a 1-D row) outside the top-k and the top-p nucleus with -inf.
    The most likely token always stays, however small ``top_p`` is (a ``top_p``
    that rounds to 0 in the logits' dtype would otherwise mask every token)."""
    if top_k and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p   # keep the token that crosses p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled (non-greedy) row draws from: temperature, then
    top-k and top-p, then softmax. ``logits`` is one row ``[vocab]``."""
    return torch.softmax(filter_logits(logits.float() / p.temperature, p.top_k, p.top_p), dim=-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None],
           errors: dict[int, str] | None = None) -> torch.Tensor:
    """Pick one token per row of ``logits`` ``[S, vocab]``; returns ``[S]`` (on device).

    With ``errors`` (a dict), a row whose draw fails (say, NaN probabilities
    from non-finite logits) is recorded there, row -> message, instead of
    raising, so one request's failure does not end the others'."""
    tokens = torch.argmax(logits, dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        try:
            tokens[row] = torch.multinomial(sampling_probs(logits[row], p), 1, generator=gen)[0]
        except RuntimeError as e:
            if errors is None:
                raise
            errors[row] = f"sampling failed: {e}"
    return tokens
