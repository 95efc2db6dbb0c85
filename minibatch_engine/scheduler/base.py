"""The scheduler: it owns the requests and their progress.

Every step the engine calls, in this order:

1. :meth:`Scheduler.schedule` -> :class:`SchedulerOutput`: who runs, how many
   tokens each computes (a snapshot: the runner reads it, never changes it);
2. the model runner executes it and returns the sampled tokens;
3. :meth:`Scheduler.update_from_output`: the scheduler advances
   ``num_computed_tokens``, tells the KV manager which tokens now have K/V,
   appends the sampled tokens, forks parallel samples, and finishes requests
   (freeing their memory). vLLM's ``update_from_output`` and nano-vllm's
   ``postprocess`` do the same job.

:meth:`Scheduler.finish_requests` is the one way to end requests from outside
(abort, a cancelled stream); the samples of an ``n > 1`` request end with it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Iterable

from ..request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from ..runner.base import RunnerOutput

# Sample k of an n > 1 request is "<parent id>#<k>"; the engine keeps user ids out of this form.
SAMPLE_ID = re.compile(r".*#\d+", re.DOTALL)


@dataclass(slots=True)
class ScheduledRequest:
    """``num_tokens`` of ``request``'s tokens, from position ``start`` on.

    Built by the scheduler and read-only afterwards: ``start`` is the request's
    ``num_computed_tokens`` when it was scheduled, ``samples`` says whether this
    step computes its last known token (then a new token is sampled), and
    ``forks`` lists the samples of an ``n > 1`` request that are forked from the
    same logits. ``spec_token_ids``: the proposed tokens among the
    ``num_tokens`` (after the known ones), verified by this step (chapter 9).
    """
    request: Request
    num_tokens: int
    start: int = -1
    samples: bool = False
    forks: list[Request] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        r = self.request
        if self.start < 0:
            self.start = r.num_computed_tokens
        end, known = self.start + self.num_tokens, r.num_tokens
        self.samples = end >= known
        if r.spec_token_ids:
            self.spec_token_ids = r.spec_token_ids[:max(0, end - known)]

    @property
    def num_spec_tokens(self) -> int:
        return len(self.spec_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: known ones, then the proposals."""
        end = self.start + self.num_tokens - self.num_spec_tokens
        return self.request.all_token_ids[self.start:end] + self.spec_token_ids

    @property
    def is_prefill(self) -> bool:
        """True for prompt work (a whole prompt or a chunk of it) and for the
        multi-token recompute of a request resuming after preemption."""
        return self.num_tokens - len(self.spec_token_ids) > 1 or self.start < len(self.request.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.request.request_id


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


@dataclass(frozen=True)
class Preemption:
    """A running request whose KV memory was taken this step."""
    request_id: str
    mode: str              # "recompute" or "swap"
    num_bytes: int = 0     # KV bytes copied to host memory (swap)
    for_request_id: str | None = None   # the request it made room for (None: itself)


@dataclass(frozen=True)
class SwapIn:
    """A swapped-out request whose KV blocks were copied back this step."""
    request_id: str
    num_bytes: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    padding: list[PaddingWork] = field(default_factory=list)
    step: int = 0                    # index of the step (the trace's row)
    batch_id: int | None = None      # static batching numbers its batches
    preempted: list[Preemption] = field(default_factory=list)
    swapped_in: list[SwapIn] = field(default_factory=list)
    # requests that ended since the last step: the runner drops their sampling state
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.padding

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_padding_tokens(self) -> int:
        return sum(p.num_tokens for p in self.padding)

    @property
    def swap_bytes(self) -> int:
        """KV bytes copied between host and device this step, both ways."""
        return sum(p.num_bytes for p in self.preempted) + sum(s.num_bytes for s in self.swapped_in)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens this step verifies (speculative decoding)."""
        return sum(s.num_spec_tokens for s in self.scheduled)

    @property
    def num_logits_rows(self) -> int:
        """Rows of logits the step needs: one per sequence, plus one per proposed token."""
        return len(self.scheduled) + len(self.padding) + self.num_spec_tokens

    def sequence_shapes(self) -> list[tuple[int, int]]:
        """(new tokens, context length after the step) of every sequence the step
        computes, padding included: what a cost model needs."""
        shapes = [(s.num_tokens, s.start + s.num_tokens) for s in self.scheduled]
        shapes += [(p.num_tokens, p.start_position + p.num_tokens) for p in self.padding]
        return shapes


class Scheduler:
    """Base class: the request registry and the update rule every scheduler shares.

    Subclasses decide who runs (:meth:`_schedule`) and keep their queues
    (:meth:`_enqueue`, :meth:`_remove`, :meth:`_release`)."""

    name = "base"

    def __init__(self, kv_cache, max_num_seqs: int):
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.requests: dict[str, Request] = {}     # every request seen, forked samples too
        self.num_steps = 0                          # non-empty steps scheduled so far
        self.now: float | None = None               # the engine's clock at this step
        self._finished_ids: list[str] = []

    # --- requests in ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        request.arrival_step = self.num_steps
        self._enqueue(request)

    # --- one step ---------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Decide this step's work (see the subclass's ``_schedule``). ``now`` is
        the engine's clock (seconds), for policies that look at waiting time."""
        self.now = now
        out = self._schedule()
        if out.is_empty:
            return out
        out.step = self.num_steps
        self.num_steps += 1
        out.finished_request_ids, self._finished_ids = self._finished_ids, []
        for s in out.scheduled:
            r = s.request
            if r.first_scheduled_step is None:
                r.first_scheduled_step = out.step
            if s.samples and r.awaits_fork:
                s.forks = [self._make_sample(r, k) for k in range(1, r.sampling_params.n)]
        return out

    def update_from_output(self, sched: SchedulerOutput, out: "RunnerOutput") -> list[Request]:
        """Advance every scheduled request by what the step computed and sampled;
        returns the requests (and forked samples) that finished in it."""
        finished: list[Request] = []
        mark_computed, sampled, step = self.kv_cache.mark_computed, out.sampled_token_ids, sched.step
        errors = out.errors
        for s in sched.scheduled:
            r = s.request
            if r.is_finished:             # ended from outside since it was scheduled
                continue
            if errors and s.spec_token_ids and r.request_id in errors:
                r.spec_token_ids = []
                finished += self._fail([r], errors, step)
                continue
            if s.spec_token_ids:
                self._verified(r, s, sampled[r.request_id])
            else:
                r.num_computed_tokens = s.start + s.num_tokens
                mark_computed(r.request_id, r.all_token_ids, r.num_computed_tokens, s.start)
            if not s.samples:
                continue
            for child in s.forks:
                self._fork(r, child)
            for seq in (r, *s.forks):
                if errors and seq.request_id in errors:
                    finished += self._fail([seq], errors, step)
                    continue
                for token in sampled[seq.request_id]:
                    seq.append_token(token, step)
                    if seq.is_finished:
                        finished.append(seq)
                        self._end(seq)
                        break
        return finished

    def _fail(self, seqs: list[Request], errors: dict[str, str], step: int) -> list[Request]:
        """End the sequences whose step failed in the runner (finish reason
        ``error``, the message kept on the request); the rest of the batch goes on."""
        for seq in seqs:
            seq.error = errors[seq.request_id]
            seq.finish(step, FinishReason.ERROR)
            self._end(seq)
        return seqs

    def _verified(self, r: Request, s: ScheduledRequest, sampled: list[int]) -> None:
        """Speculative rollback. ``sampled`` is the accepted prefix of the proposals
        plus one token from the target, so only ``len(sampled) - 1`` proposals
        count as computed: the K/V slots of the rejected ones are given back (the
        trailing blocks freed), and only blocks of accepted tokens can enter the
        prefix cache."""
        accepted = len(sampled) - 1
        if not 0 <= accepted <= s.num_spec_tokens or sampled[:accepted] != s.spec_token_ids[:accepted]:
            raise RuntimeError(f"request {r.request_id}: the runner returned {sampled} for proposals "
                               f"{s.spec_token_ids}: not an accepted prefix plus one token")
        r.num_computed_tokens = s.start + s.num_tokens - s.num_spec_tokens + accepted
        r.spec_token_ids = []
        self.kv_cache.truncate(r.request_id, r.num_computed_tokens)
        self.kv_cache.mark_computed(r.request_id, r.all_token_ids + sampled[:accepted],
                                    r.num_computed_tokens, s.start)

    def set_proposals(self, proposals: dict[str, list[int]]) -> None:
        """Speculative decoding: every running request's proposals for the next step
        (a request missing from ``proposals`` gets none). Only a decoding request
        takes proposals, capped so that verifying them cannot run past
        ``max_tokens``: k proposals yield at most k + 1 tokens."""
        for r in self.running_requests():
            spec = proposals.get(r.request_id, []) if r.is_decoding else []
            room = r.sampling_params.max_tokens - r.num_output_tokens - 1
            r.spec_token_ids = [int(t) for t in spec[:max(0, room)]]

    def running_requests(self) -> list[Request]:
        """Requests that may run this step (speculation proposes only for these)."""
        return []

    def finish_requests(self, request_ids: str | Iterable[str],
                        reason: FinishReason = FinishReason.ABORT) -> list[Request]:
        """End requests wherever they are (waiting, running, swapped out); their
        memory is given back at once. The samples of an ``n > 1`` request end
        with it. Returns the requests that were ended by this call."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ended = []
        for rid in ids:
            if rid not in self.requests:
                raise KeyError(f"unknown request {rid!r}")
            req = self.requests[rid]
            for r in [req, *(self.requests[c] for c in req.child_ids)]:
                if r.is_finished:
                    continue
                self._remove(r)
                r.finish(self.num_steps, reason)
                self._end(r)
                ended.append(r)
        return ended

    def forget(self, request_id: str) -> None:
        """Drop a finished request, and its ``n > 1`` samples, from ``requests``
        (which otherwise keeps every request ever seen, for the run's analysis).
        A long-running server calls this once it has delivered the output."""
        group = self.samples_of(request_id) if request_id in self.requests else None
        if group is None:
            raise KeyError(f"unknown request {request_id!r}")
        if group[0].parent_id is not None:
            raise ValueError(f"{request_id!r} is a sample of {group[0].parent_id!r}: forget that one")
        if not all(r.is_finished for r in group):
            raise ValueError(f"request {request_id!r} has not finished: abort it first")
        for r in group:
            del self.requests[r.request_id]
            self._forgotten(r)

    def _forgotten(self, request: Request) -> None:
        """Hook: ``request`` has left the registry (a policy drops what it kept)."""

    def samples_of(self, request_id: str) -> list[Request]:
        """A request and, for n > 1, its forked samples, in order."""
        req = self.requests[request_id]
        return [req, *(self.requests[c] for c in req.child_ids)]

    # --- parallel sampling ------------------------------------------------------
    def _make_sample(self, parent: Request, k: int) -> Request:
        """Sample ``k`` of an n > 1 request: the same prompt, seed ``seed + k``."""
        p = parent.sampling_params
        return Request(f"{parent.request_id}#{k}", parent.prompt_token_ids,
                       replace(p, n=1, seed=None if p.seed is None else p.seed + k),
                       prompt=parent.prompt, eos_token_id=parent.eos_token_id,
                       priority=parent.priority, client_id=parent.client_id,
                       parent_id=parent.request_id, arrival_step=parent.arrival_step,
                       arrival_time=dict(parent.arrival_time),
                       first_scheduled_step=parent.first_scheduled_step)

    def _fork(self, parent: Request, child: Request) -> None:
        """The prompt was prefilled once; the sample shares its KV blocks
        (copy-on-write) and runs from now on."""
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child.request_id] = child
        parent.child_ids.append(child.request_id)
        self.kv_cache.fork(parent.request_id, child.request_id)
        child.status = RequestStatus.RUNNING
        self._add_running(child)

    def _end(self, request: Request) -> None:
        self._finished_ids.append(request.request_id)
        self._release(request)

    # --- what subclasses implement ----------------------------------------------
    def _schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    def _enqueue(self, request: Request) -> None:
        """A new request joins the waiting queue."""
        raise NotImplementedError

    def _add_running(self, request: Request) -> None:
        """A forked sample starts out running."""
        raise NotImplementedError

    def _remove(self, request: Request) -> None:
        """Take an unfinished request out of the queues (it is being ended)."""
        raise NotImplementedError

    def _release(self, request: Request) -> None:
        """A request finished: give its memory back (now, or when its batch ends)."""
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    @property
    def num_running(self) -> int:
        raise NotImplementedError
