"""The model-runner interface: run one SchedulerOutput, return the sampled tokens.

A runner owns tensors and sampling state and never sees a request: it reads
the step's plain-data :class:`~minibatch_engine.core.outputs.SchedulerOutput` and
returns a :class:`~minibatch_engine.core.outputs.RunnerOutput`; the scheduler
applies it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..core.outputs import RunnerOutput, SchedulerOutput


class Runner(ABC):
    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Carry out one step: the block copies, then the forward (or its modelled time)."""
