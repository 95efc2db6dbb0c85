"""SimExecutor: no model at all. It returns a placeholder token for every request
that samples, so a scheduler can be driven at production scale (an 8B model on
an H100) on a laptop; the time comes from the engine's cost model."""
from __future__ import annotations

from ..scheduler.base import SchedulerOutput
from .base import Executor, ExecutorOutput, needs_fork, sampling_rows


class SimExecutor(Executor):
    def __init__(self, token_id: int = 0):
        self.token_id = token_id

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        reqs = [r for _, r in sampling_rows(sched)]
        forks = {r.request_id: [(self.token_id, None)] * (r.sampling_params.n - 1) for r in reqs if needs_fork(r)}
        return ExecutorOutput(sampled={r.request_id: self.token_id for r in reqs}, forks=forks)
