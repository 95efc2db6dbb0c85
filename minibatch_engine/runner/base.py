"""The model-runner interface: run one SchedulerOutput, return the sampled tokens.

A runner owns tensors and sampling state and never changes a request: it reads
the step's snapshot (:class:`~minibatch_engine.scheduler.SchedulerOutput`) and
returns a :class:`RunnerOutput`; the scheduler applies it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..scheduler.base import SchedulerOutput


@dataclass
class RunnerOutput:
    """The sampled tokens of every request (and forked sample) whose step computed
    its last known token, keyed by request id (a list: one token per step today;
    speculative decoding can accept several).

    ``errors``: request id -> message, for a request whose sampling failed this
    step; it has no entry in ``sampled_token_ids``, and the scheduler ends it
    with finish reason ``error`` while the rest of the batch goes on."""
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    forward_s: float = 0.0      # wall seconds in the model forward
    sample_s: float = 0.0       # wall seconds in sampling (and the copy to host)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(map(len, self.sampled_token_ids.values()))


def sampling_rows(sched: SchedulerOutput):
    """(row in the step's logits, scheduled request) for every scheduled request
    that samples this step."""
    return [(i, s) for i, s in enumerate(sched.scheduled) if s.samples]


class Runner:
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        raise NotImplementedError
