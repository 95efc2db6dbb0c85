"""Static batching: one batch at a time, padded, until its longest request ends.

This is what ``model.generate`` on a padded batch does. Up to ``B`` waiting
requests form a batch; the prompts are left-padded to the longest one and
prefilled together; then all lanes decode in lockstep until the last request
ends. A lane whose request finished early keeps computing a pad token every
step until then, and keeps its KV slot: the waste is real compute, which the
trace counts. The batch's KV rows are given back when its last request ends.
"""
from __future__ import annotations

from collections import deque

from ..core.request import Request, RequestStatus
from ..core.outputs import PaddingWork, ScheduledRequest, SchedulerOutput
from .base import Scheduler


class StaticScheduler(Scheduler):
    name = "static"

    def __init__(self, kv_cache, max_num_seqs: int, max_model_len: int):
        super().__init__(kv_cache, max_num_seqs)
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.batch: list[Request] = []           # the current batch, in lane order
        self.next_position: dict[str, int] = {}  # finished lanes: where their pad token goes
        self.batch_id = -1

    # --- queues -------------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        if request.sampling_params.n > 1:
            raise ValueError("static batching does not fork samples (n > 1); "
                             "use the continuous scheduler with the paged cache")
        self.waiting.append(request)

    def _add_running(self, request: Request) -> None:
        raise ValueError("static batching runs no forked samples: parallel sampling (n > 1) needs "
                         "the continuous scheduler and the paged cache")

    def _remove(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        # A request of the current batch becomes a padded lane, like a finished one.

    def _release(self, request: Request) -> None:
        """A finished lane keeps its row (and computes pad tokens) until the whole
        batch is done; then every row of the batch is given back."""
        if self.batch and all(r.is_finished for r in self.batch):
            for r in self.batch:
                self.kv_cache.free(r.request_id)
            self.batch, self.next_position = [], {}

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(not r.is_finished for r in self.batch)

    # --- one step -------------------------------------------------------------------
    def _form_batch(self) -> None:
        """Take waiting requests in arrival order while the padded layout fits:
        at most ``max_num_seqs`` lanes and ``max(prompt) + max(max_tokens) <= max_model_len``."""
        longest_prompt = longest_output = 0
        while self.waiting and len(self.batch) < self.max_num_seqs:
            req = self.waiting[0]
            p = max(longest_prompt, req.num_prompt_tokens)
            g = max(longest_output, req.sampling_params.max_tokens)
            if self.batch and p + g > self.max_model_len:
                break
            if not self.kv_cache.allocate(req.request_id, req.num_prompt_tokens):
                break
            longest_prompt, longest_output = p, g
            self.batch.append(self.waiting.popleft())
        if self.batch:
            self.batch_id += 1

    def _schedule(self) -> SchedulerOutput:
        if not self.batch:
            self._form_batch()
        out = SchedulerOutput(batch_id=self.batch_id)
        if not self.batch:
            return out
        table = lambda rid: list(self.kv_cache.block_table(rid))    # noqa: E731 (a copy: plain data)
        if all(r.num_computed_tokens == 0 for r in self.batch):
            # Prefill: every lane computes max(prompt) tokens; short prompts are padded.
            longest = max(r.num_prompt_tokens for r in self.batch)
            for r in self.batch:
                if r.is_finished:           # ended before its prefill: a pad lane
                    out.padding.append(PaddingWork(longest, 0, r.request_id, table(r.request_id)))
                    continue
                r.status = RequestStatus.RUNNING
                out.scheduled.append(ScheduledRequest.of(r, r.num_prompt_tokens, admitted=True))
                if r.num_prompt_tokens < longest:
                    out.padding.append(PaddingWork(longest - r.num_prompt_tokens, 0, r.request_id))
            return out
        # Decode in lockstep: one token per lane, real or pad.
        for r in self.batch:
            if not r.is_finished:
                self.kv_cache.allocate(r.request_id, r.num_tokens)
                out.scheduled.append(ScheduledRequest.of(r, 1))
            else:
                pos = self.next_position.setdefault(r.request_id, r.num_computed_tokens)
                out.padding.append(PaddingWork(1, pos, r.request_id, table(r.request_id)))
                self.next_position[r.request_id] = pos + 1
        return out
