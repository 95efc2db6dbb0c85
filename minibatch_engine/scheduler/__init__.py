"""Schedulers: every batching strategy of the book behind one interface."""
from .base import PaddingWork, ScheduledRequest, Scheduler, SchedulerOutput
from .continuous import ContinuousScheduler
from .static import StaticScheduler

SCHEDULERS = {"static": StaticScheduler, "continuous": ContinuousScheduler}


def make_scheduler(name: str, kv_cache, max_num_seqs: int, max_model_len: int) -> Scheduler:
    """Build a scheduler by name (``static`` or ``continuous``)."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}")
    return SCHEDULERS[name](kv_cache, max_num_seqs, max_model_len)


__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest", "PaddingWork",
           "StaticScheduler", "ContinuousScheduler", "SCHEDULERS", "make_scheduler"]
