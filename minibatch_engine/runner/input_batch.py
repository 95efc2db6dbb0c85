"""The persistent batch: the runner's own record of every running request.

The runner keeps one :class:`CachedRequestState` per running request (vLLM
V1's ``InputBatch`` and ``CachedRequestState``). It holds the request's token
ids, ``num_computed_tokens``, block-table row and sampling parameters. Each
step's :class:`~minibatch_engine.core.outputs.SchedulerOutput` updates it in place
(:meth:`InputBatch.update`):

- a request that ended or was preempted since the last step leaves;
- a request admitted this step (``prefix_token_ids`` is set) enters whole;
- a running request keeps its tokens up to ``start`` and takes the step's
  known tokens, its new ``num_computed_tokens`` and its block-table row.

After sampling, :meth:`InputBatch.append_sampled` adds the sampled tokens, and
a forked sample of an ``n > 1`` request enters as a copy of its parent
(:meth:`InputBatch.fork`). So the record always holds each request's known
tokens: the step's inputs, the penalties' history and the proposer's context
all come from it, never from the scheduler's ``Request``. vLLM keeps the same
record in preallocated arrays, one row per request, to copy them to the GPU
in one go. Here the rows are Python lists, and the step's tensors are built
from them once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.outputs import SchedulerOutput


@dataclass(slots=True)
class CachedRequestState:
    """One running request as the runner knows it.

    ``token_ids``: its known tokens (prompt, then output), up to the last one
    sampled; never the proposals under verification. ``num_computed_tokens``:
    tokens whose K/V the target holds at the start of the step that last
    scheduled it. ``block_table``: its KV blocks after that step's allocation.
    """
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: object
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)


class InputBatch:
    """Request id -> :class:`CachedRequestState`, updated from each step's
    ``SchedulerOutput`` instead of rebuilt."""

    def __init__(self):
        self.requests: dict[str, CachedRequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __getitem__(self, request_id: str) -> CachedRequestState:
        return self.requests[request_id]

    def __len__(self) -> int:
        return len(self.requests)

    def get(self, request_id: str) -> CachedRequestState | None:
        return self.requests.get(request_id)

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def update(self, sched: SchedulerOutput) -> None:
        """Apply one step's ``SchedulerOutput``: drop the requests that ended or
        lost their KV, add the admitted ones, advance the running ones."""
        for rid in sched.finished_request_ids:
            self.remove(rid)
        for p in sched.preempted:
            self.remove(p.request_id)
        for s in sched.scheduled:
            known = s.token_ids[:s.num_tokens - s.num_spec_tokens]
            if s.prefix_token_ids is not None:
                state = self.requests[s.request_id] = CachedRequestState(
                    s.request_id, s.prefix_token_ids + known, s.num_prompt_tokens, s.sampling_params)
            else:
                state = self.requests.get(s.request_id)
                if state is None:
                    raise KeyError(f"request {s.request_id} is scheduled as running, but the runner's "
                                   "input batch never saw it admitted (no prefix_token_ids)")
                del state.token_ids[s.start:]
                state.token_ids += known
            state.num_computed_tokens = s.start
            state.block_table = s.block_table

    def append_sampled(self, request_id: str, token_ids: list[int]) -> None:
        """The step sampled ``token_ids`` for the request (accepted proposals too)."""
        self.requests[request_id].token_ids += token_ids

    def fork(self, parent_id: str, request_id: str, sampling_params, first_token_ids: list[int]) -> None:
        """A sample forked from ``parent_id``'s logits: its parent's tokens, then
        its own first ones (its block table comes with its first scheduled step)."""
        parent = self.requests[parent_id]
        self.requests[request_id] = CachedRequestState(
            request_id, parent.token_ids + first_token_ids, parent.num_prompt_tokens, sampling_params,
            parent.num_computed_tokens, list(parent.block_table))

    def token_ids(self, request_id: str) -> list[int]:
        """The request's known tokens (the record itself: do not modify)."""
        return self.requests[request_id].token_ids
