"""The executor interface: run one SchedulerOutput, return the sampled tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request
from ..scheduler.base import SchedulerOutput


@dataclass
class ExecutorOutput:
    sampled: dict[str, int] = field(default_factory=dict)   # request_id -> token
    # n > 1: request_id -> first (token, generator) of each extra sample, forked after prefill
    forks: dict[str, list] = field(default_factory=dict)
    forward_s: float = 0.0      # wall seconds in the model forward
    sample_s: float = 0.0       # wall seconds in sampling (and the copy to host)


def sampling_rows(sched: SchedulerOutput) -> list[tuple[int, Request]]:
    """(row in the step's logits, request) for every scheduled request whose step
    computes its last known token: those sample a new one."""
    return [(i, s.request) for i, s in enumerate(sched.scheduled)
            if s.request.num_computed_tokens + s.num_tokens == s.request.num_tokens]


def needs_fork(request) -> bool:
    """A parent of parallel sampling about to sample its first token."""
    return request.sampling_params.n > 1 and request.parent_id is None and request.num_output_tokens == 0


class Executor:
    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        raise NotImplementedError
