"""SimRunner: no model at all. It returns a placeholder token for every request
that samples, so a scheduler can be driven at production scale (an 8B model on
an H100) on a laptop; the time comes from the engine's cost model.

Speculative decoding needs to know how many proposals the target would accept,
which depends on the text. The simulator models it: each proposed token is
accepted with probability ``acceptance_rate``, independently, in order, until
the first rejection (a seeded Bernoulli draw; the i.i.d. assumption of
Leviathan et al. 2023, section 3.5). Then comes one target token, as always.
"""
from __future__ import annotations

import random

from ..core.outputs import RunnerOutput, SchedulerOutput
from ..speculative.proposer import Proposer
from .base import Runner


class SimRunner(Runner):
    """``proposer``: speculative decoding's stand-in (a ``SimProposer``), asked
    after each step for the sequences that sampled, as the ``ModelRunner`` asks
    its own; it keeps no tokens, only lengths."""

    def __init__(self, token_id: int = 0, acceptance_rate: float = 0.0, seed: int = 0,
                 proposer: Proposer | None = None):
        self.token_id, self.acceptance_rate = token_id, acceptance_rate
        self.rng = random.Random(seed)
        self.proposer = proposer

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        if self.proposer is not None:
            for rid in [*sched.finished_request_ids, *(p.request_id for p in sched.preempted)]:
                self.proposer.free(rid)
        seqs = []
        for s in sched.scheduled:
            if not s.samples_token:
                continue
            accepted = 0
            while accepted < s.num_spec_tokens and self.rng.random() < self.acceptance_rate:
                accepted += 1
            n = s.start + s.num_tokens - s.num_spec_tokens + accepted + 1    # its tokens after the step
            for rid, params in [(s.request_id, s.sampling_params), *((f.request_id, f.sampling_params)
                                                                     for f in s.forks)]:
                out.sampled_token_ids[rid] = s.spec_token_ids[:accepted] + [self.token_id]
                if self.proposer is not None:
                    seqs.append(self.proposer.input_for(rid, n, s.num_prompt_tokens, params))
        if seqs:
            out.spec_token_ids = self.proposer.propose(seqs)
            out.draft_shapes = self.proposer.last_draft_shapes
        return out
