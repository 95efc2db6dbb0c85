"""How to pick each next token and when to stop: :class:`SamplingParams`,
shaped like vLLM's. The sampler that draws with them is
:mod:`~minibatch_engine.sampling.sampler`."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

from .structured_output import StructuredOutputsParams


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
    ``stop``: strings that end the output where they first appear, left out of
    its text (vLLM's ``stop``); text is checked after detokenising, by the front
    door (``LLM``, ``AsyncLLM``), as vLLM checks it outside its engine core.

    The rest are vLLM's, with vLLM's meaning, applied inside the batched sampler
    (:mod:`minibatch_engine.sampling.logits_process`): ``presence_penalty``,
    ``frequency_penalty``, ``repetition_penalty``, ``min_p``, ``min_tokens``,
    ``logit_bias`` (token id -> bias, stored as sorted pairs), ``bad_words``
    (strings, turned into ``bad_words_token_ids`` by the front door's
    tokenizer), ``include_stop_str_in_output``, ``truncate_prompt_tokens``
    (keep the prompt's last k tokens; -1: as many as fit), and
    log-probabilities (:mod:`minibatch_engine.sampling.logprobs`): ``logprobs=N`` returns
    each sampled token's log-probability and the N most likely tokens',
    ``prompt_logprobs=N`` the same for every prompt token; both from the raw
    model distribution (vLLM V1's default ``logprobs_mode``).
    ``structured_outputs``: a grammar the output must follow (JSON schema,
    regex, choice, EBNF, any JSON object; a
    :class:`~minibatch_engine.sampling.structured_output.StructuredOutputsParams` or a
    dict of its fields), enforced by a token mask at every step
    (:mod:`minibatch_engine.sampling.structured_output`).
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
    structured_outputs: Any = None

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
        object.__setattr__(self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs))

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
