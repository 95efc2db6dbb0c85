"""SimRunner: no model at all. It returns a placeholder token for every request
that samples, so a scheduler can be driven at production scale (an 8B model on
an H100) on a laptop; the time comes from the engine's cost model."""
from __future__ import annotations

from ..scheduler.base import SchedulerOutput
from .base import Runner, RunnerOutput, sampling_rows


class SimRunner(Runner):
    def __init__(self, token_id: int = 0):
        self.token_id = token_id

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = RunnerOutput()
        for _, s in sampling_rows(sched):
            for seq in [s.request, *s.forks]:
                out.sampled_token_ids[seq.request_id] = [self.token_id]
        return out
