"""The scheduler interface: each step, who runs and how many tokens each computes."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..request import Request


@dataclass
class ScheduledRequest:
    """``num_tokens`` of ``request``'s known tokens, starting at ``num_computed_tokens``."""
    request: Request
    num_tokens: int

    @property
    def is_prefill(self) -> bool:
        """True for prompt work (a whole prompt or a chunk of it) and for the
        multi-token recompute of a request resuming after preemption."""
        return self.num_tokens > 1 or self.request.num_computed_tokens < self.request.num_prompt_tokens


@dataclass
class PaddingWork:
    """Compute spent on no request's behalf: pad tokens of a padded batch.

    ``block_table=None`` writes the pad K/V into the pool's null block.
    ``owner`` is the request whose lane the padding fills (for the trace).
    """
    num_tokens: int
    start_position: int
    owner: Request
    block_table: list[int] | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    padding: list[PaddingWork] = field(default_factory=list)
    batch_id: int | None = None      # static batching numbers its batches
    preempted: list = field(default_factory=list)   # (request_id, "recompute" | "swap")
    swap_bytes: int = 0              # KV bytes copied between host and device this step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.padding

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_padding_tokens(self) -> int:
        return sum(p.num_tokens for p in self.padding)

    def sequence_shapes(self) -> list[tuple[int, int]]:
        """(new tokens, context length after the step) of every sequence the step
        computes, padding included: what a cost model needs."""
        shapes = [(s.num_tokens, s.request.num_computed_tokens + s.num_tokens) for s in self.scheduled]
        shapes += [(p.num_tokens, p.start_position + p.num_tokens) for p in self.padding]
        return shapes


class Scheduler:
    """Base class. A scheduler owns the waiting queue and the running set and talks
    to the KV-cache manager; the engine calls it in this order every step:
    ``schedule()``, (the executor runs), then ``on_request_finished`` for each
    request that finished in that step."""

    name = "base"

    def __init__(self, kv_cache, max_num_seqs: int):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    def on_request_finished(self, request: Request) -> None:
        """Called once when a request finishes (length, stop or abort)."""
        raise NotImplementedError

    def abort(self, request: Request) -> None:
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    @property
    def num_running(self) -> int:
        raise NotImplementedError
