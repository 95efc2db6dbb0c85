"""What crosses between the scheduler and the model runner each step: plain data.

:class:`SchedulerOutput` is the scheduler's decision, :class:`RunnerOutput` the
runner's answer. Both hold only ints, strings, lists, tuples and small
dataclasses of those (a :class:`~minibatch_engine.sampling.params.SamplingParams` is
one; the step's grammar bitmask is a numpy array): no ``Request``, no tensor,
no KV manager. Each scheduled request carries
what the runner needs to compute it (its token ids, positions, block table,
sampling parameters), so the runner never reads a request, and a
``SchedulerOutput`` survives a ``pickle`` round trip unchanged, as it would
have to for a runner in another process (vLLM V1 sends its ``SchedulerOutput``
to the workers the same way).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling.params import SamplingParams
from ..sampling.structured_output import GrammarBitmask


@dataclass(frozen=True, slots=True)
class Fork:
    """A sample of an ``n > 1`` request, forked this step from its parent's logits."""
    request_id: str
    sampling_params: SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """``num_tokens`` tokens of one request, from position ``start`` on.

    ``token_ids``: the tokens this step computes (known ones, then the proposals
    ``spec_token_ids`` it verifies, chapter 9). ``samples_token``: the step
    computes the request's last known token, so a token is sampled; ``forks``
    are the samples of an ``n > 1`` request forked from the same logits.
    ``block_table``: the request's KV blocks after this step's allocation (the
    K/V of the new tokens go there). ``prefix_token_ids``: on the step that
    admits the request from the waiting queue (or swaps it back in), its
    tokens before ``start`` (those found in the prefix cache, or those whose
    K/V came back from host memory; empty from position 0), so the runner's
    persistent batch (:mod:`~minibatch_engine.runner.input_batch`) starts it
    whole; None on the steps after (vLLM V1's
    ``NewRequestData`` and ``CachedRequestData``). Built by the scheduler
    (:meth:`of`), read-only afterwards.
    """
    request_id: str
    num_tokens: int
    start: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    samples_token: bool = False
    spec_token_ids: list[int] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    prefix_token_ids: list[int] | None = None

    @classmethod
    def of(cls, request, num_tokens: int, admitted: bool = False) -> "ScheduledRequest":
        """A snapshot of ``request`` computing ``num_tokens`` tokens from its
        ``num_computed_tokens`` on (the scheduler adds forks and block table);
        ``admitted``: this step admits it, so its earlier tokens go along."""
        start, known = request.num_computed_tokens, request.num_tokens
        end = start + num_tokens
        spec = request.spec_token_ids[:max(0, end - known)] if request.spec_token_ids else []
        tokens = request.all_token_ids
        return cls(request.request_id, num_tokens, start, tokens[start:end - len(spec)] + spec,
                   request.num_prompt_tokens, request.sampling_params, end >= known, spec,
                   prefix_token_ids=tokens[:start] if admitted else None)

    @property
    def num_spec_tokens(self) -> int:
        return len(self.spec_token_ids)

    @property
    def is_prefill(self) -> bool:
        """True for prompt work (a whole prompt or a chunk of it) and for the
        multi-token recompute of a request resuming after preemption."""
        return self.num_tokens - len(self.spec_token_ids) > 1 or self.start < self.num_prompt_tokens


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One KV block the runner copies before the step's forward: ``"copy"``
    (device to device: copy-on-write of a shared block), ``"swap_out"``
    (device block ``src`` to host block ``dst``) or ``"swap_in"`` (host block
    ``src`` to device block ``dst``)."""
    kind: str
    src: int
    dst: int


@dataclass(slots=True)
class PaddingWork:
    """Compute spent on no request's behalf: pad tokens of a padded batch.

    ``block_table=None`` writes the pad K/V into the pool's null block.
    ``owner_id`` is the request whose lane the padding fills (for the trace).
    """
    num_tokens: int
    start: int
    owner_id: str
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
    # requests that ended since the last step: the runner drops their state (sampling, tokens, draft)
    finished_request_ids: list[str] = field(default_factory=list)
    # KV blocks the runner copies before the forward, in the order the scheduler decided them
    block_copies: list[BlockCopy] = field(default_factory=list)
    # structured output: the token masks of the sequences that sample under a grammar
    grammar: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        """Nothing to compute (there may still be block copies to carry out)."""
        return not self.scheduled and not self.padding

    def blocks_to(self, kind: str) -> list[tuple[int, int]]:
        """(src, dst) of this step's block copies of one kind: ``"copy"``,
        ``"swap_out"`` or ``"swap_in"`` (vLLM V0's ``blocks_to_copy``,
        ``blocks_to_swap_out``, ``blocks_to_swap_in``)."""
        return [(c.src, c.dst) for c in self.block_copies if c.kind == kind]

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
        shapes += [(p.num_tokens, p.start + p.num_tokens) for p in self.padding]
        return shapes


@dataclass
class RunnerOutput:
    """The sampled tokens of every request (and forked sample) whose step computed
    its last known token, keyed by request id (a list: one token, or with
    speculative decoding the accepted proposals and one more).

    ``errors``: request id -> message, for a request whose sampling failed this
    step; it has no entry in ``sampled_token_ids``, and the scheduler ends it
    with finish reason ``error`` while the rest of the batch goes on.

    ``spec_token_ids``: speculative decoding's guesses for the next step, made
    by the runner's proposer after sampling, for sequences that sampled (the
    scheduler stores them on the requests that go on decoding);
    ``draft_shapes``: (new tokens, context after) of each sequence in each of the
    draft model's forwards, which the simulator prices. ``logprobs`` and
    ``prompt_logprobs``: for requests that ask for them, plain-list entries
    (:mod:`minibatch_engine.sampling.logprobs`)."""
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    prepare_s: float = 0.0      # wall seconds building the step's inputs and attention metadata
    forward_s: float = 0.0      # wall seconds in the model forward
    sample_s: float = 0.0       # wall seconds in sampling (and the copy to host)
    draft_s: float = 0.0        # wall seconds in the proposer
    draft_shapes: list[list[tuple[int, int]]] = field(default_factory=list)
    # log-probabilities (minibatch_engine.sampling.logprobs): request id -> one entry per sampled token,
    # and request id -> (first prompt position, entries) for the prompt tokens this step scored
    logprobs: dict[str, list] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(map(len, self.sampled_token_ids.values()))
