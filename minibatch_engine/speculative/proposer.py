"""Proposers: cheap guesses of a decoding request's next k tokens.

Before each step the engine asks the proposer for guesses for every running
request that is decoding; the scheduler stores them on the request
(``spec_token_ids``) and schedules them as extra query tokens, and the target
verifies them in the same forward as everything else (:mod:`.verify`).

A proposer returns plain token ids and never changes a request. It may keep
state per request id (a draft model's KV cache); :meth:`Proposer.free_except`
drops the state of requests that stopped running (finished, aborted,
preempted). It reports what its last call cost: wall seconds, and the shapes of
the draft forwards it ran, which the simulator prices with the draft model's
roofline.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..request import Request


class Proposer(ABC):
    """Base class. ``num_speculative_tokens`` (k): most guesses per request and step."""

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        # per draft forward of the last call: (new tokens, context after) of each sequence
        self.last_draft_shapes: list[list[tuple[int, int]]] = []

    def num_proposals(self, r: Request) -> int:
        """Guesses worth making: at most k, and never past max_tokens (``Request.max_proposals``)."""
        return min(self.k, r.max_proposals)

    @abstractmethod
    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        """Request id -> its proposed tokens (at most ``num_proposals(r)`` each)."""

    def free_except(self, live_ids: set[str]) -> None:
        """Forget every request not in ``live_ids`` (stateless proposers keep nothing)."""


class SimProposer(Proposer):
    """The simulator's stand-in: k placeholder tokens per request (the SimRunner
    decides acceptance by a seeded draw). With ``draft_model=True`` it also
    records the shapes a draft model would run: catching up on the tokens it has
    not seen (the whole prompt at first), then one token per further guess."""

    def __init__(self, num_speculative_tokens: int, draft_model: bool, token_id: int = 0):
        super().__init__(num_speculative_tokens)
        self.draft_model, self.token_id = draft_model, token_id
        self.fed: dict[str, int] = {}      # request id -> tokens the draft has K/V for

    def propose(self, requests):
        out, steps = {}, [[] for _ in range(self.k)]
        for r in requests:
            k = self.num_proposals(r)
            if k == 0:
                continue
            out[r.request_id] = [self.token_id] * k
            if self.draft_model:
                n = r.num_tokens
                # valid draft K/V: what it was fed, up to what the target accepted
                valid = min(self.fed.get(r.request_id, 0), r.num_computed_tokens, n - 1)
                steps[0].append((n - valid, n))
                for j in range(1, k):
                    steps[j].append((1, n + j))
                self.fed[r.request_id] = n + k - 1
        self.last_draft_shapes = [s for s in steps if s]
        return out

    def free_except(self, live_ids):
        for rid in [r for r in self.fed if r not in live_ids]:
            del self.fed[rid]
