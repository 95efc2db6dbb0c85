"""The scheduler's knobs, validated where they are used (``EngineConfig``
composes this with the other owners' configs and keeps one flat keyword
interface for users)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.checks import check_bool, check_choice, check_int, check_number
from .policy import POLICIES
from .preemption import PREEMPTION_MODES, VICTIMS

SCHEDULER_NAMES = ("continuous", "static")


def check_token_budget(budget: int | None, chunked: bool, max_num_seqs: int, max_model_len: int) -> None:
    """A budget must leave room for progress: at least one token per running
    sequence with chunking, a whole longest prompt without it."""
    if budget is None:
        return
    if chunked and budget < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({max_num_seqs}), "
            "or decode tokens could fill every step and starve prefills")
    if not chunked and budget < max_model_len:
        raise ValueError(
            f"without chunked prefill max_num_batched_tokens ({budget}) must be >= max_model_len "
            f"({max_model_len}), or a long prompt could never be scheduled; raise the budget or "
            "enable chunked prefill")


@dataclass(frozen=True)
class SchedulerConfig:
    """Who runs, how many tokens, who is preempted and how (see
    :class:`~minibatch_engine.config.EngineConfig` for each field)."""
    scheduler: str = "continuous"
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None | str = "auto"
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1
    preemption_mode: str = "recompute"
    preemption_victim: str = "latest"
    policy: str = "fcfs"
    priority_aging_s: float | None = None
    client_weights: dict | None = None

    def __post_init__(self):
        check_choice("scheduler", self.scheduler, SCHEDULER_NAMES)
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_choice("preemption_victim", self.preemption_victim, VICTIMS)
        check_choice("policy", self.policy, POLICIES)
        if self.priority_aging_s is not None:
            check_number("priority_aging_s", self.priority_aging_s, 0.0, 1e9, low_open=True)
            if self.policy != "priority":
                raise ValueError(f"priority_aging_s={self.priority_aging_s!r} needs policy='priority' "
                                 f"(policy is {self.policy!r})")
        if self.client_weights is not None:
            if self.policy != "fair":
                raise ValueError(f"client_weights needs policy='fair' (policy is {self.policy!r})")
            if not isinstance(self.client_weights, dict) or not all(
                    not isinstance(w, bool) and isinstance(w, (int, float)) and math.isfinite(w) and w > 0
                    for w in self.client_weights.values()):
                raise ValueError(f"client_weights must map client ids to numbers > 0, got {self.client_weights!r}")
        if self.policy != "fcfs":
            if self.scheduler != "continuous":
                raise ValueError(f"policy={self.policy!r} needs the continuous scheduler (static batching "
                                 "forms its batches in arrival order)")
            if self.preemption_victim != "latest":
                raise ValueError(f"preemption_victim={self.preemption_victim!r} applies to policy='fcfs'; "
                                 f"under policy={self.policy!r} the policy chooses the victim")
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_model_len", self.max_model_len, 2, optional=True)
        check_int("max_num_partial_prefills", self.max_num_partial_prefills, 1)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.max_num_batched_tokens != "auto":
            check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        if self.scheduler == "static" and self.max_num_batched_tokens not in ("auto", None):
            raise ValueError("a token budget (max_num_batched_tokens) needs the continuous scheduler")
