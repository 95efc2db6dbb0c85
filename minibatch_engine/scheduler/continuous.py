"""Iteration-level (continuous) batching, first come first served.

Orca's idea: decide the batch at every step (iteration), not once per batch.
Requests that finished in the previous step have already given back their KV
memory; free places are refilled from the waiting queue at once, and a newly
admitted request's whole prompt is prefilled in the same step as the running
requests' decode tokens.

The rule for how many tokens a request computes is the one vLLM V1 uses for
every case: ``num_tokens - num_computed_tokens``, everything it knows but has
not computed. That is the whole prompt for a new request, one token for a
decoding one, and prompt plus outputs for a request resuming after preemption;
chunked prefill (chapter 5) will only cap it by a token budget.

With a paged KV cache, admission is by free blocks, and a running request that
cannot get a block for its next token takes memory back from the most recently
arrived running request (preemption by recompute: the victim's blocks are freed
and it re-queues at the front, to be prefilled again later).
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
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request that starts out running (a fork of parallel sampling)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        # 1. Everyone running computes what it has not computed yet (one decode token),
        #    taking memory from the latest arrivals if the cache is full.
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.kv_cache.allocate(req.request_id, req.num_tokens, req.num_computed_tokens):
                out.scheduled.append(ScheduledRequest(req, req.num_tokens - req.num_computed_tokens))
                i += 1
            else:
                self._preempt(self.running[-1])      # may be req itself; then i stays past the end
        # 2. Free places are refilled from the queue, in arrival order, this very step.
        while self.waiting and len(self.running) + self.waiting[0].sampling_params.n <= self.max_num_seqs:
            req = self.waiting[0]
            if not self._admit(req):
                break                       # no KV memory: wait for someone to finish
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_tokens - req.num_computed_tokens))
        return out

    def _admit(self, req: Request) -> bool:
        """Reuse cached prefix blocks, then take blocks for the rest (keeping the
        cache's watermark free)."""
        hit = self.kv_cache.match_prefix(req.request_id, req.all_token_ids)
        if self.kv_cache.allocate(req.request_id, req.num_tokens, hit, admit=True):
            req.num_computed_tokens = hit
            req.num_cached_tokens += hit
            return True
        self.kv_cache.free(req.request_id)            # give the matched prefix back
        return False

    def _preempt(self, victim: Request) -> None:
        """Recompute preemption: free the victim's KV memory; it re-queues first."""
        self.running.remove(victim)
        self.kv_cache.free(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

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
