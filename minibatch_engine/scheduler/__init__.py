"""Schedulers: every batching strategy of the book behind one interface."""
from .base import PaddingWork, Preemption, ScheduledRequest, Scheduler, SchedulerOutput, SwapIn
from .continuous import ContinuousScheduler
from .static import StaticScheduler

SCHEDULERS = {"static": StaticScheduler, "continuous": ContinuousScheduler}

__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest", "PaddingWork", "Preemption", "SwapIn",
           "StaticScheduler", "ContinuousScheduler", "SCHEDULERS"]
