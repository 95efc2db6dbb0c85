"""What a serving front end reports after each engine step (vLLM V1's
``SchedulerStats`` and ``IterationStats``), for its stat loggers: Prometheus
(``minibatch_engine.entrypoints.server.metrics``) or anything with a ``record`` method.

Plain data, no engine object: in vLLM V1 these cross from the engine-core
process to the API server with each step's outputs. Times are wall seconds
seen by the front end (the stream's submission, the delivery of a token), the
same clock a client would use, less the network.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SchedulerStats:
    """The engine's state after a step: the gauges."""
    num_running_reqs: int = 0          # requests (sequences of n > 1 count once each) being computed
    num_waiting_reqs: int = 0          # submitted, not yet admitted (or preempted, waiting to return)
    kv_cache_usage: float = 0.0        # share of KV blocks (rows) some request holds, in [0, 1]


@dataclass
class FinishedRequestStats:
    """One request that ended, as its stream saw it."""
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float                  # submission -> last output (seconds)
    queued_time: float | None           # submission -> first scheduled (None: never scheduled)


@dataclass
class IterationStats:
    """What happened since the last report: the counters and histograms."""
    num_prompt_tokens: int = 0          # prompts of requests that got their first token
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    prefix_cache_queries: int = 0       # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int = 0          # of those, tokens found cached


class StatLogger(Protocol):
    """Anything ``AsyncLLM(stat_loggers=[...])`` reports to, after every step."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
