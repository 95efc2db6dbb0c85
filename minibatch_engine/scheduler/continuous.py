"""Iteration-level (continuous) batching, first come first served, with an
optional per-step token budget (chunked prefill).

Orca's idea: decide the batch at every step (iteration), not once per batch.
Requests that finished in the previous step have already given back their KV
memory; free places are refilled from the waiting queue at once, and a newly
admitted request's prompt is prefilled in the same step as the running
requests' decode tokens.

How many tokens a request computes follows one rule, the one vLLM V1 uses for
every case: everything it knows but has not computed,
``num_tokens - num_computed_tokens``, capped by what is left of the step's
token budget (``max_num_batched_tokens``); with speculative decoding the
known tokens include a decoding request's proposals
(``num_tokens_with_spec``), so verifying them is the same rule. Without a budget that is the whole
prompt for a newcomer and one token for a decoding request. With a budget and
chunked prefill (Sarathi-Serve), decode tokens are scheduled first and prompts
fill what is left in chunks, so a long prompt no longer stalls everyone's next
token; a prompt may then take several steps, tracked by
``num_computed_tokens``.

With a paged KV cache, admission is by free blocks, and a running request that
cannot get a block for its next tokens takes memory back from a victim (see
:mod:`.preemption`): recomputed later, or swapped to host memory and back.
Swapped-out requests come back before any new request is admitted.

Who is admitted next, and who is preempted, is the job of a scheduling policy
(:mod:`.policy`): first come first served by default, priority with
preemption, or fair share between clients (VTC).
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace

from ..kv.base import NO_PREFIX
from ..core.request import Request, RequestStatus
from ..core.outputs import ScheduledRequest, SchedulerOutput
from .config import check_token_budget
from .base import Scheduler
from .policy import FCFSPolicy, SchedulingPolicy
from .preemption import Preemptor


class _Step:
    """What one call of ``schedule`` has handed out so far."""

    def __init__(self, budget: int | None):
        self.out = SchedulerOutput()
        self.token_budget = budget if budget is not None else float("inf")   # tokens left this step
        self.granted: dict[int, int] = {}      # id(request) -> tokens this step
        self.partial = 0                       # prompts whose prefill spans steps

    def grant(self, req: Request, n: int, spans: bool) -> None:
        self.granted[id(req)] = n
        self.token_budget -= n
        self.partial += spans


class ContinuousScheduler(Scheduler):
    name = "continuous"

    def __init__(self, kv_cache, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int | None = None, enable_chunked_prefill: bool = True,
                 max_num_partial_prefills: int = 1, preemptor: Preemptor | None = None,
                 policy: SchedulingPolicy | None = None):
        super().__init__(kv_cache, max_num_seqs)
        check_token_budget(max_num_batched_tokens, enable_chunked_prefill, max_num_seqs, max_model_len)
        if max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be >= 1, got {max_num_partial_prefills}")
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_num_partial_prefills = max_num_partial_prefills
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        # swapped back in, not scheduled since: the runner dropped them when they were
        # swapped out, so the step that next schedules one admits it again
        self.readmit: set[str] = set()
        self.preemptor = preemptor or Preemptor(kv_cache)
        self.policy = policy or FCFSPolicy()
        self.preemptor.policy = self.policy      # the policy chooses the victim
        # vLLM's prefix-cache counters, in tokens: every admission looks its
        # request's tokens up (queries) and finds some cached (hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- queues -------------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        self.policy.on_arrival(request, self.waiting)
        self.waiting.append(request)

    def _add_running(self, request: Request) -> None:
        self.running.append(request)

    def _remove(self, request: Request) -> None:
        self.policy.on_finish(request, was_waiting=request in self.waiting)
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.swapped:
            self.swapped.remove(request)
            self.preemptor.discard(request)
        elif request in self.running:
            self.running.remove(request)
        self.readmit.discard(request.request_id)

    def _release(self, request: Request) -> None:
        """A finished request leaves the batch and frees its KV memory at once."""
        self.readmit.discard(request.request_id)
        if request in self.running:
            self.running.remove(request)
            self.policy.on_finish(request)
        self.kv_cache.free(request.request_id)

    def _forgotten(self, request: Request) -> None:
        self.policy.forget(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_seqs(self) -> int:
        """Sequences running, counting the samples an n > 1 request will fork into."""
        return sum(r.num_seqs for r in self.running)

    # --- one step -------------------------------------------------------------------
    def _grant(self, req: Request, token_budget: int) -> int:
        """Tokens ``req`` may compute this step with ``token_budget`` left (0: none).
        A decoding request's proposed tokens are optional: a tight budget trims them."""
        remaining = req.num_tokens_with_spec - req.num_computed_tokens
        if remaining <= token_budget:
            return remaining
        return int(token_budget) if self.enable_chunked_prefill or req.is_decoding else 0

    def _schedule(self) -> SchedulerOutput:
        """One step: running requests first (decode tokens, then prefill chunks),
        then swapped-out requests, then newcomers, within the token budget."""
        step = _Step(self.max_num_batched_tokens)
        self.policy.begin_step(self.now, self.running)
        bad = self.policy.unorderable([*self.waiting, *self.running, *self.swapped])
        if bad:         # a request the policy cannot place ends alone, before any decision uses it
            self._failed += self.fail_requests(bad)
        self._schedule_running(step)
        self._schedule_swapped(step)
        self._schedule_waiting(step)
        return step.out

    def _schedule_running(self, step: "_Step") -> None:
        """Decode tokens first, then the prompts (or chunks) of requests part-way
        through their prefill. A request that cannot get KV blocks takes them
        from a victim (by default the latest arrival)."""
        decodes: list[Request] = []
        prompts: list[Request] = []
        for r in self.running:
            (decodes if r.is_decoding else prompts).append(r)
        preempted: set[int] = set()
        allocate = self.kv_cache.allocate
        for is_decode, group in ((True, decodes), (False, prompts)):
            for req in group:
                if id(req) in preempted:
                    continue
                while True:        # until req gets its blocks, or is itself the victim
                    n = self._grant(req, step.token_budget)
                    spans = n > 0 and not is_decode and \
                        (n < req.num_tokens - req.num_computed_tokens or req.num_computed_tokens > 0)
                    if n == 0 or (spans and step.partial >= self.max_num_partial_prefills):
                        break
                    if allocate(req.request_id, req.num_computed_tokens + n, req.num_computed_tokens):
                        step.grant(req, n, spans)
                        break
                    victim = self.preemptor.pick_victim(self.running)
                    preempted.add(id(victim))
                    step.out.preempted.append(self._preempt(victim, req))
                    step.token_budget += step.granted.pop(id(victim), 0)
                    if victim is req:
                        break
        granted = step.granted
        step.out.scheduled = [ScheduledRequest.of(r, granted[id(r)], admitted=r.request_id in self.readmit)
                              for r in self.running if id(r) in granted]
        self.readmit.difference_update(s.request_id for s in step.out.scheduled)

    def _schedule_swapped(self, step: "_Step") -> None:
        """Swapped-out requests come back first, when memory allows (and nobody was
        preempted this step, which would only swap them out again)."""
        while self.swapped and not step.out.preempted and step.token_budget > 0 \
                and self.num_seqs() + self.swapped[0].num_seqs <= self.max_num_seqs \
                and not self._waiting_outranks(self.swapped[0]) \
                and self.preemptor.can_swap_in(self.swapped[0], bool(self.running)):
            req = self.swapped.popleft()
            step.out.swapped_in.append(self.preemptor.swap_in(req))
            self.running.append(req)
            n = self._grant(req, step.token_budget)
            if n and self.kv_cache.allocate(req.request_id, req.num_computed_tokens + n, req.num_computed_tokens):
                step.grant(req, n, n > 1)
                step.out.scheduled.append(ScheduledRequest.of(req, n, admitted=True))
            else:               # back in memory, not in this step: its next step admits it
                self.readmit.add(req.request_id)

    def _waiting_outranks(self, swapped: Request) -> bool:
        """Under a policy that orders swapped-out requests too, a better waiting
        request is admitted before ``swapped`` comes back (FCFS: never)."""
        return self.policy.orders_swapped and bool(self.waiting) and \
            self.policy.beats(self.policy.select(self.waiting), swapped)

    def _schedule_waiting(self, step: "_Step") -> None:
        """Free places are refilled from the queue this very step, in the policy's
        order (FCFS: arrival order). An n > 1 request counts as the n sequences it
        will fork into. When the next request cannot be admitted, for want of KV
        blocks or of a place, the policy may preempt a running request for it
        (priority: one of strictly worse priority); otherwise it waits, and so
        does everyone behind it (no skipping ahead)."""
        while self.waiting and step.token_budget > 0 and \
                not (self.swapped and not self._waiting_outranks(self.swapped[0])):
            req = self.policy.select(self.waiting)
            if self.num_seqs() + req.num_seqs > self.max_num_seqs:
                if self._preempt_for(req, step):
                    continue
                break
            n, short_of_memory = self._admit(req, step.token_budget,
                                             allow_partial=step.partial < self.max_num_partial_prefills)
            if n == 0:
                if short_of_memory and self._preempt_for(req, step):
                    continue
                break                       # no KV memory or budget: wait
            self.waiting.remove(req)
            self.policy.on_admit(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            step.grant(req, n, n < req.num_tokens - req.num_computed_tokens)
            step.out.scheduled.append(ScheduledRequest.of(req, n, admitted=True))

    def _preempt_for(self, req: Request, step: "_Step") -> bool:
        """Preempt the running request the policy names to make room for waiting
        ``req``; its grant this step (if any) is taken back. False: none named."""
        victim = self.policy.victim_for(req, self.running)
        if victim is None:
            return False
        step.token_budget += step.granted.pop(id(victim), 0)
        step.out.scheduled = [s for s in step.out.scheduled if s.request_id != victim.request_id]
        step.out.preempted.append(self._preempt(victim, req))
        return True

    def _admit(self, req: Request, token_budget: int, allow_partial: bool) -> tuple[int, bool]:
        """Look up cached prefix blocks, then take them together with blocks for
        what this step computes (keeping the cache's watermark free). Returns the
        tokens granted (0: not admitted, nothing taken) and whether KV memory,
        not the token budget, was what stopped it."""
        # a prompt found in the cache has no logits: prompt log-probabilities skip the lookup (vLLM V1)
        prefix = NO_PREFIX if req.sampling_params.prompt_logprobs is not None else \
            self.kv_cache.find_cached_prefix(req.all_token_ids, req.block_hashes)
        remaining = req.num_tokens - prefix.num_tokens
        n = remaining if remaining <= token_budget else (token_budget if self.enable_chunked_prefill else 0)
        # The watermark keeps room for running requests to grow; with none running
        # it would only stop a request that needs the whole pool from ever starting.
        headroom = self.kv_cache.watermark_blocks if self.running else 0
        if not n or not (allow_partial or n == remaining):
            return 0, False
        if self.kv_cache.allocate(req.request_id, prefix.num_tokens + n, prefix.num_tokens,
                                  prefix=prefix, headroom=headroom):
            req.num_computed_tokens = prefix.num_tokens
            req.num_cached_tokens += prefix.num_tokens
            if getattr(getattr(self.kv_cache, "manager", None), "enable_prefix_caching", False):
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += prefix.num_tokens
            return n, False
        return 0, True

    def _preempt(self, victim: Request, beneficiary: Request | None = None):
        """Take the victim's KV memory, for ``beneficiary`` (the request that could
        not grow or be admitted); the victim waits to be swapped back in, or
        re-queues to be recomputed: at the head under FCFS, else in its place by
        the policy's order (priority and arrival are kept)."""
        self.running.remove(victim)
        self.readmit.discard(victim.request_id)
        done = self.preemptor.preempt(victim)
        if beneficiary is not None and beneficiary is not victim:
            done = replace(done, for_request_id=beneficiary.request_id)
        if done.mode == "swap":
            self.swapped.append(victim)
        else:
            self.policy.on_requeue(victim, self.waiting)
            if self.policy.requeue_at_head:
                self.waiting.appendleft(victim)
            else:
                self.waiting.append(victim)
        return done
