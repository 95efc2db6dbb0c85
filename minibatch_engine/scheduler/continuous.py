"""Iteration-level (continuous) batching, first come first served.

Orca's idea: decide the batch at every step (iteration), not once per batch.
Requests that finished in the previous step have already given back their KV
slot; free slots are refilled from the waiting queue at once, and a newly
admitted request's whole prompt is prefilled in the same step as the running
requests' decode tokens.

The rule for how many tokens a request computes is the one vLLM V1 uses for
every case: ``num_tokens - num_computed_tokens``, everything it knows but has
not computed. That is the whole prompt for a new request and one token for a
decoding one; chunked prefill (chapter 5) will only cap it by a token budget.
"""
from __future__ import annotations

from collections import deque

from ..request import Request, RequestStatus
from .base import ScheduledRequest, Scheduler, SchedulerOutput


class ContinuousScheduler(Scheduler):
    name = "continuous"

    def __init__(self, kv_cache, max_num_seqs: int, max_model_len: int):
        super().__init__(kv_cache, max_num_seqs)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # 1. Everyone running computes what it has not computed yet (one decode token).
        for req in self.running:
            n = req.num_tokens - req.num_computed_tokens
            self.kv_cache.allocate(req.request_id, req.num_tokens)
            out.scheduled.append(ScheduledRequest(req, n))
        # 2. Free slots are refilled from the queue, in arrival order, this very step.
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.kv_cache.allocate(req.request_id, req.num_tokens):
                break                       # no KV memory: wait for someone to finish
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_tokens - req.num_computed_tokens))
        return out

    def on_request_finished(self, request: Request) -> None:
        """A finished request leaves the batch and frees its KV memory at once."""
        if request in self.running:
            self.running.remove(request)
        self.kv_cache.free(request.request_id)

    def abort(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)
