"""Proposers: cheap guesses of a decoding request's next k tokens.

The runner runs the proposer at the end of each step, after sampling (vLLM
V1's shape): for every sequence that has just sampled, it hands over its
tokens from the runner's persistent batch (:class:`ProposalInput`), and returns the
guesses in ``RunnerOutput.spec_token_ids``. The scheduler stores them on the
request and schedules them next step as extra query tokens, and the target
verifies them in the same forward as everything else (:mod:`.verify`).

A proposer returns plain token ids and never sees a request. It may keep state
per request id (a draft model's KV cache); :meth:`Proposer.free` drops it when
the runner hears that a request finished or was preempted. It reports what its
last call cost: the shapes of the draft forwards it ran, which the simulator
prices with the draft model's roofline.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(slots=True)
class ProposalInput:
    """A sequence that has just sampled, as the runner sees it: its tokens so far
    (``token_ids``; the simulator keeps none and gives only ``num_tokens``), its
    prompt length, and how many guesses are worth making (``num_proposals``: at
    most k, never past ``max_tokens``, see ``SamplingParams.max_proposals``)."""
    request_id: str
    num_tokens: int
    num_prompt_tokens: int
    num_proposals: int
    token_ids: list[int] = field(default_factory=list)


class Proposer(ABC):
    """Base class. ``num_speculative_tokens`` (k): most guesses per request and step."""

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        # per draft forward of the last call: (new tokens, context after) of each sequence
        self.last_draft_shapes: list[list[tuple[int, int]]] = []

    def input_for(self, request_id: str, num_tokens: int, num_prompt_tokens: int, params,
                  token_ids: list[int] | None = None) -> ProposalInput:
        """A sequence that has just sampled, with the guesses worth making for it:
        at most k, never past ``max_tokens`` (``SamplingParams.max_proposals``)."""
        cap = min(self.k, params.max_proposals(num_tokens - num_prompt_tokens))
        return ProposalInput(request_id, num_tokens, num_prompt_tokens, cap,
                             token_ids if token_ids is not None else [])

    @abstractmethod
    def propose(self, seqs: list[ProposalInput]) -> dict[str, list[int]]:
        """Request id -> its proposed tokens (at most ``num_proposals`` each)."""

    def free(self, request_id: str) -> None:
        """Forget a request that finished or lost its KV memory (stateless proposers keep nothing)."""


class SimProposer(Proposer):
    """The simulator's stand-in: k placeholder tokens per request (the SimRunner
    decides acceptance by a seeded draw). With ``draft_model=True`` it also
    records the shapes a draft model would run: catching up on the tokens it has
    not seen (the whole prompt at first), then one token per further guess."""

    def __init__(self, num_speculative_tokens: int, draft_model: bool, token_id: int = 0):
        super().__init__(num_speculative_tokens)
        self.draft_model, self.token_id = draft_model, token_id
        self.fed: dict[str, int] = {}      # request id -> tokens the draft has K/V for

    def propose(self, seqs):
        out, steps = {}, [[] for _ in range(self.k)]
        for s in seqs:
            k = s.num_proposals
            if k == 0:
                continue
            out[s.request_id] = [self.token_id] * k
            if self.draft_model:
                n = s.num_tokens
                # valid draft K/V: what it was fed, up to the target's accepted tokens (all but the last)
                valid = min(self.fed.get(s.request_id, 0), n - 1)
                steps[0].append((n - valid, n))
                for j in range(1, k):
                    steps[j].append((1, n + j))
                self.fed[s.request_id] = n + k - 1
        self.last_draft_shapes = [s for s in steps if s]
        return out

    def free(self, request_id):
        self.fed.pop(request_id, None)
