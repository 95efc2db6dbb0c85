"""Schedulers: every batching strategy of the book behind one interface."""
from .base import PaddingWork, ScheduledRequest, Scheduler, SchedulerOutput
from .continuous import ContinuousScheduler
from .static import StaticScheduler

SCHEDULERS = {"static": StaticScheduler, "continuous": ContinuousScheduler}


def make_scheduler(name: str, kv_cache, max_num_seqs: int, max_model_len: int, **options) -> Scheduler:
    """Build a scheduler by name (``static`` or ``continuous``). ``options`` go to
    the continuous scheduler (token budget, chunked prefill, preemptor); static
    batching takes none of them."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}")
    if name == "static":
        if options.get("max_num_batched_tokens") is not None:
            raise ValueError("a token budget (max_num_batched_tokens) needs the continuous scheduler")
        return StaticScheduler(kv_cache, max_num_seqs, max_model_len)
    return SCHEDULERS[name](kv_cache, max_num_seqs, max_model_len, **options)


__all__ = ["Scheduler", "SchedulerOutput", "ScheduledRequest", "PaddingWork",
           "StaticScheduler", "ContinuousScheduler", "SCHEDULERS", "make_scheduler"]
