"""A request and its life: WAITING -> RUNNING -> (PREEMPTED -> RUNNING)* -> FINISHED.

The one number the schedulers reason about is ``num_computed_tokens``: how many
of the request's known tokens (prompt plus outputs so far) already have K/V in
the cache. A request needs ``num_tokens - num_computed_tokens`` more tokens
computed before it can sample again: the whole prompt at first (prefill), then
one token per step (decode). With speculative decoding (chapter 9) a decoding
request also carries ``spec_token_ids``, proposed tokens not yet verified, and
needs ``num_tokens_with_spec - num_computed_tokens`` tokens computed: its one
real token plus the proposals, verified in the same forward.

A request is plain data (no tensors). The scheduler is the only part that
changes it, in ``Scheduler.update_from_output`` and ``Scheduler.finish_requests``;
the model runner never sees it (it reads the step's ``SchedulerOutput``) and
keeps its sampling state (a seeded generator per request id) itself.
"""
from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field

from ..sampling.params import SamplingParams


# A request's priority is a 32-bit signed integer, as in gRPC's and Kubernetes'
# priority fields. vLLM takes any Python int (its scheduler only compares them);
# this engine's aging turns a priority into a float (``priority - waited /
# aging_s``), which an integer past 2**1023 cannot become, and one past 2**53
# no longer keeps its order exactly. 2**31 levels are more than any tenant
# scheme needs and stay exact in that float for 10**6 years of aging.
PRIORITY_MIN, PRIORITY_MAX = -2**31, 2**31 - 1


def check_priority(priority, what: str = "priority") -> int:
    """``priority`` as an int, or a ``ValueError``/``TypeError`` naming ``what``,
    the value and the range (:data:`PRIORITY_MIN` to :data:`PRIORITY_MAX`). The
    one check every way in uses: ``Engine.add_request`` (so ``LLM`` and
    ``AsyncLLM``), and the server's request parser."""
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"{what} must be an integer, got {_short(priority)}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"{what} must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower runs "
                         f"first), got {_short(priority)}")
    return int(priority)


def _short(value) -> str:
    """``repr(value)``, cut to 40 characters (a 5,000-digit integer is not echoed whole)."""
    if isinstance(value, int) and abs(value) >= 10**30:     # (str() refuses over 4,300 digits)
        return f"an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"      # max_tokens reached
    STOP = "stop"          # EOS or a stop token
    ABORT = "abort"        # ended from outside (abort, a cancelled stream)
    ERROR = "error"        # its own step failed (e.g. sampling); the other requests go on

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    eos_token_id: int | None = None
    priority: int = 0                         # lower runs earlier (vLLM's convention)
    client_id: str | None = None              # the tenant, for fair-share scheduling
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0                # prompt tokens found in the prefix cache
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)   # proposals for the next step (chapter 9)
    block_hashes: list[int] = field(default_factory=list)    # its full blocks' prefix-cache hashes, once each
    num_recomputed_tokens: int = 0            # K/V thrown away by recompute preemption
    num_swaps: int = 0
    parent_id: str | None = None              # set on the forked samples of n > 1
    child_ids: list[str] = field(default_factory=list)   # n > 1: the forked samples
    finish_reason: FinishReason | None = None
    error: str | None = None                  # why, when finish_reason is ERROR
    # Timestamps, as engine step indices (the trace maps steps to seconds in each clock).
    arrival_step: int = 0
    arrival_time: dict = field(default_factory=dict)   # clock name -> seconds
    first_scheduled_step: int | None = None
    token_steps: list[int] = field(default_factory=list)
    finish_step: int | None = None
    logprobs: list | None = None              # one entry per output token (SamplingParams.logprobs)
    prompt_logprobs: list | None = None       # one per prompt token, None first (prompt_logprobs)
    _token_ids: list[int] = field(default_factory=list, init=False, repr=False)   # prompt + outputs

    def __post_init__(self):
        self._token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.logprobs is None and self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.prompt_logprobs is None and self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Record the prompt log-probabilities of positions ``first``, ``first + 1``, ...;
        positions already recorded (recomputed after a preemption) are kept as they were."""
        for i, e in enumerate(entries):
            if first + i == len(self.prompt_logprobs) and first + i < self.num_prompt_tokens:
                self.prompt_logprobs.append(e)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)      # prompt + outputs (kept in step by append_token)

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens plus the proposed ones this step will verify."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Prompt done and one token to compute: the state in which tokens can be proposed."""
        computed = self.num_computed_tokens     # (read for every running request every step)
        return len(self._token_ids) - computed == 1 and computed >= len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (kept up to date as tokens arrive; do not modify)."""
        return self._token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can ever hold: prompt plus ``max_tokens``."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def max_proposals(self) -> int:
        """Proposed tokens worth verifying next step (``SamplingParams.max_proposals``)."""
        return self.sampling_params.max_proposals(self.num_output_tokens)

    @property
    def awaits_fork(self) -> bool:
        """A parent of parallel sampling (n > 1) that has not sampled yet: its
        first step that samples forks it into n sequences."""
        return self.sampling_params.n > 1 and self.parent_id is None and not self.child_ids

    @property
    def num_seqs(self) -> int:
        """Sequences this request will occupy once forked (1, or n before its fork)."""
        return self.sampling_params.n if self.awaits_fork else 1

    def append_token(self, token: int, step: int) -> None:
        """Record a sampled token and decide whether the request is done."""
        self.output_token_ids.append(token)
        self._token_ids.append(token)
        self.token_steps.append(step)
        p = self.sampling_params
        if token in p.stop_token_ids or (not p.ignore_eos and token == self.eos_token_id):
            self.finish(step, FinishReason.STOP)
        elif len(self.output_token_ids) >= p.max_tokens:
            self.finish(step, FinishReason.LENGTH)

    def finish(self, step: int, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = FinishReason(reason)
        self.finish_step = step

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
