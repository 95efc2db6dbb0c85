"""The scheduler: it owns the requests and their progress.

Every step the engine calls, in this order:

1. :meth:`Scheduler.schedule` -> :class:`~minibatch_engine.core.outputs.SchedulerOutput`:
   who runs, how many tokens each computes, and what the runner needs to
   compute them (plain data: token ids, positions, block tables);
2. the model runner executes it and returns the sampled tokens (and, with
   speculative decoding, its proposer's guesses for the next step);
3. :meth:`Scheduler.update_from_output`: the scheduler advances
   ``num_computed_tokens``, tells the KV manager which tokens now have K/V,
   appends the sampled tokens (a constrained sequence's grammar matcher
   accepts each, :mod:`~minibatch_engine.sampling.structured_output`), forks parallel
   samples, finishes requests
   (freeing their memory) and stores the guesses on those that go on. vLLM's ``update_from_output`` and nano-vllm's
   ``postprocess`` do the same job.

:meth:`Scheduler.finish_requests` is the one way to end requests from outside
(abort, a cancelled stream); the samples of an ``n > 1`` request end with it.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Iterable

from ..core.outputs import Fork, RunnerOutput, SchedulerOutput
from ..core.request import FinishReason, Request, RequestStatus

# Sample k of an n > 1 request is "<parent id>#<k>"; the engine keeps user ids out of this form.
SAMPLE_ID = re.compile(r".*#\d+", re.DOTALL)


def sample_id(parent_id: str, k: int) -> str:
    return f"{parent_id}#{k}"


def sample_params(p, k: int):
    """Sample ``k``'s parameters: one sequence, seeded ``seed + k``."""
    return replace(p, n=1, seed=None if p.seed is None else p.seed + k)


class Scheduler(ABC):
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
        self._failed: list[Request] = []            # ended with an error outside update_from_output
        # structured output: compiled grammars and one matcher per sequence
        # (a StructuredOutputManager, set by the engine when a request first needs one)
        self.structured_output = None

    # --- requests in ------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        grammar = request.sampling_params.structured_outputs
        if grammar is not None:
            if self.structured_output is None:
                raise ValueError(f"request {request.request_id}: structured_outputs needs the scheduler's "
                                 "StructuredOutputManager (Engine.add_request sets one up)")
            self.structured_output.add_request(request.request_id, grammar)
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
        out.block_copies = self.kv_cache.take_block_copies()    # for the runner, before its forward
        out.finished_request_ids, self._finished_ids = self._finished_ids, []
        if out.is_empty:
            return out
        out.step = self.num_steps
        self.num_steps += 1
        block_table = self.kv_cache.block_table
        for s in out.scheduled:
            r = self.requests[s.request_id]
            if r.first_scheduled_step is None:
                r.first_scheduled_step = out.step
            if s.samples_token and r.awaits_fork:
                s.forks = [Fork(sample_id(r.request_id, k), sample_params(r.sampling_params, k))
                           for k in range(1, r.sampling_params.n)]
            s.block_table = list(block_table(s.request_id))
        if self.structured_output is not None and self.structured_output.matchers:
            out.grammar = self._grammar_bitmask(out)
        return out

    def _grammar_bitmask(self, out: SchedulerOutput):
        """The token masks of the sequences this step samples under a grammar
        (a sample forked this step samples from its parent's state); None when
        there are none."""
        so, rows = self.structured_output, []
        for s in out.scheduled:
            if s.samples_token and s.request_id in so:
                rows.append((s.request_id, s.request_id))
                rows += [(f.request_id, s.request_id) for f in s.forks]
        return so.grammar_bitmask(rows) if rows else None

    def update_from_output(self, sched: SchedulerOutput, out: RunnerOutput) -> list[Request]:
        """Advance every scheduled request by what the step computed and sampled;
        returns the requests (and forked samples) that finished in it. A sequence
        that goes on decoding takes the runner's proposals for the next step
        (speculative decoding), capped so that verifying them cannot run past
        ``max_tokens``: k proposals yield at most k + 1 tokens."""
        finished: list[Request] = []
        for s in sched.scheduled:
            r = self.requests.get(s.request_id)
            if r is None or r.is_finished:      # ended from outside since it was scheduled
                continue
            try:
                self._update_one(r, s, sched.step, out, finished)
            except Exception as e:              # this request's update failed: it ends, the batch goes on
                finished += self.fail_requests({r.request_id: f"its step failed: {type(e).__name__}: {e}"})
        return finished

    def _update_one(self, r: Request, s, step: int, out: RunnerOutput, finished: list[Request]) -> None:
        """:meth:`update_from_output` for one scheduled request (and its forks)."""
        errors, proposals, sampled = out.errors, out.spec_token_ids, out.sampled_token_ids
        if errors and s.spec_token_ids and r.request_id in errors:
            r.spec_token_ids = []
            finished += self._fail([r], errors, step)
            return
        if s.spec_token_ids:
            self._verified(r, s, sampled[r.request_id])
        else:
            r.num_computed_tokens = s.start + s.num_tokens
            self.kv_cache.mark_computed(r.request_id, r.all_token_ids, r.num_computed_tokens, s.start)
            if out.prompt_logprobs and r.request_id in out.prompt_logprobs:
                r.add_prompt_logprobs(*out.prompt_logprobs[r.request_id])
        if not s.samples_token:
            return
        forks = [self._fork(r, k) for k in range(1, len(s.forks) + 1)]
        for seq in (r, *forks):
            if errors and seq.request_id in errors:
                finished += self._fail([seq], errors, step)
                continue
            if out.logprobs and seq.request_id in out.logprobs:
                seq.logprobs.extend(out.logprobs[seq.request_id])
            for token in sampled[seq.request_id]:
                refused = self._append(seq, token, step)
                if refused:
                    finished += self._fail([seq], {seq.request_id: refused}, step)
                    break
                if seq.is_finished:
                    finished.append(seq)
                    self._end(seq)
                    break
            else:
                spec = proposals.get(seq.request_id) if proposals else None
                if spec:
                    seq.spec_token_ids = [int(t) for t in spec[:seq.max_proposals]]
                elif seq.spec_token_ids:
                    seq.spec_token_ids = []

    def _append(self, seq: Request, token: int, step: int) -> str | None:
        """Append a sampled token. Under a grammar its matcher accepts the token
        first (one it refuses is not appended: the message is returned), and a
        grammar that has ended finishes the sequence (``stop``), EOS or not."""
        so = self.structured_output
        if so is None or seq.request_id not in so:
            seq.append_token(token, step)
            return None
        if not so.accept(seq.request_id, token):
            return (f"token {token} is not allowed by its structured_outputs grammar at this point "
                    "(min_tokens, bad_words or logit_bias may have ruled out every token it allows)")
        seq.append_token(token, step)
        if not seq.is_finished and so.is_terminated(seq.request_id):
            seq.finish(step, FinishReason.STOP)
        return None

    def _fail(self, seqs: list[Request], errors: dict[str, str], step: int) -> list[Request]:
        """End the sequences whose step failed in the runner (finish reason
        ``error``, the message kept on the request); the rest of the batch goes on."""
        for seq in seqs:
            seq.error = errors[seq.request_id]
            seq.finish(step, FinishReason.ERROR)
            self._end(seq)
        return seqs

    def _verified(self, r: Request, s, sampled: list[int]) -> None:
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

    def fail_requests(self, errors: dict[str, str]) -> list[Request]:
        """End requests whose own part of a step failed (finish reason ``error``,
        ``errors`` maps request id -> message, kept on each); the samples of an
        ``n > 1`` request end with it. The rest of the batch goes on."""
        ended = []
        for rid, message in errors.items():
            for r in self.finish_requests([rid], FinishReason.ERROR):
                r.error = message
                ended.append(r)
        return ended

    def take_failed(self) -> list[Request]:
        """The requests :meth:`schedule` ended with an error (say, a priority its
        policy could not order), handed over once."""
        failed, self._failed = self._failed, []
        return failed

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
    def _fork(self, parent: Request, k: int) -> Request:
        """Sample ``k`` of an n > 1 request: the same prompt, seed ``seed + k``.
        The prompt was prefilled once; the sample shares its KV blocks
        (copy-on-write) and runs from now on."""
        child = Request(sample_id(parent.request_id, k), parent.prompt_token_ids,
                        sample_params(parent.sampling_params, k),
                        prompt=parent.prompt, eos_token_id=parent.eos_token_id,
                        priority=parent.priority, client_id=parent.client_id,
                        parent_id=parent.request_id, arrival_step=parent.arrival_step,
                        arrival_time=dict(parent.arrival_time),
                        first_scheduled_step=parent.first_scheduled_step)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child.request_id] = child
        parent.child_ids.append(child.request_id)
        self.kv_cache.fork(parent.request_id, child.request_id)
        if self.structured_output is not None and parent.request_id in self.structured_output:
            self.structured_output.fork(parent.request_id, child.request_id)
        child.status = RequestStatus.RUNNING
        self._add_running(child)
        return child

    def _end(self, request: Request) -> None:
        self._finished_ids.append(request.request_id)
        if self.structured_output is not None:
            self.structured_output.free(request.request_id)
        self._release(request)

    # --- what subclasses implement ----------------------------------------------
    @abstractmethod
    def _schedule(self) -> SchedulerOutput:
        """This step's decision (``schedule`` adds forks, block tables and copies)."""

    @abstractmethod
    def _enqueue(self, request: Request) -> None:
        """A new request joins the waiting queue."""

    @abstractmethod
    def _add_running(self, request: Request) -> None:
        """A forked sample starts out running."""

    @abstractmethod
    def _remove(self, request: Request) -> None:
        """Take an unfinished request out of the queues (it is being ended)."""

    @abstractmethod
    def _release(self, request: Request) -> None:
        """A request finished: give its memory back (now, or when its batch ends)."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Any request still waiting, running or swapped out."""
