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

from ..outputs import RunnerOutput, SchedulerOutput
from .base import Runner


class SimRunner(Runner):
    def __init__(self, token_id: int = 0, acceptance_rate: float = 0.0, seed: int = 0):
        self.token_id, self.acceptance_rate = token_id, acceptance_rate
        self.rng = random.Random(seed)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        for s in sched.scheduled:
            if not s.samples_token:
                continue
            accepted = 0
            while accepted < s.num_spec_tokens and self.rng.random() < self.acceptance_rate:
                accepted += 1
            for rid in [s.request_id, *(f.request_id for f in s.forks)]:
                out.sampled_token_ids[rid] = s.spec_token_ids[:accepted] + [self.token_id]
        return out
