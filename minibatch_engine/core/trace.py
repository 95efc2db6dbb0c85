"""The per-step trace: the record every metric and figure of the book is computed from.

Each step appends one :class:`StepRecord`: who ran (and in which KV row or
first block, as prefill, decode or padding), tokens computed and tokens useful, KV memory, and
the step's times in each clock. Nothing is counted on the side.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class LaneRecord(NamedTuple):
    """One request's work in one step (a tuple: the engine makes one per request per step)."""
    request_id: str
    first_block: int   # first KV block of the request (its row, for a reserved cache); -1: none
    kind: str          # "prefill", "decode", "pad"
    num_tokens: int
    start: int = 0     # position of the first new token (tokens already cached before it)


@dataclass
class StepRecord:
    step: int
    lanes: list[LaneRecord]
    batch_id: int | None
    computed_tokens: int        # rows the forward computed
    useful_tokens: int          # rows that belong to a live request's real tokens
    prefill_tokens: int
    decode_tokens: int
    num_scheduled: int          # requests computing real tokens this step (padding lanes not counted)
    sampled_tokens: int         # output tokens produced
    kv_reserved_bytes: int
    kv_used_bytes: int
    kv_capacity_bytes: int
    wall_start: float
    wall_end: float
    # where the wall time went (all inside wall_start..wall_end; the rest is the
    # engine's bookkeeping: block copies, the runner's loops, building the record)
    schedule_s: float = 0.0     # the scheduler's decision
    prepare_s: float = 0.0      # the runner building inputs and attention metadata
    forward_s: float = 0.0      # the model's forward
    sample_s: float = 0.0       # sampling (and the copy of the tokens to the host)
    update_s: float = 0.0       # the scheduler taking in the sampled tokens
    sim_start: float | None = None
    sim_end: float | None = None
    preempted: list = field(default_factory=list)   # Preemption(request_id, mode, num_bytes)
    swap_bytes: int = 0                             # KV bytes copied host <-> device
    # speculative decoding (chapter 9)
    spec_proposed: int = 0          # proposed tokens verified this step
    spec_accepted: int = 0          # of those, accepted by the target
    num_verifications: int = 0      # requests that verified proposals
    draft_s: float = 0.0            # wall seconds spent proposing (inside wall_start..wall_end)
    draft_sim_s: float | None = None   # simulated seconds of the draft model (inside sim_start..sim_end)

    @property
    def padding_tokens(self) -> int:
        return self.computed_tokens - self.useful_tokens

    @property
    def kv_fragmentation_bytes(self) -> int:
        """Reserved KV bytes that hold no token: for a paged cache, the unused
        tails of last blocks (internal fragmentation); for a reserved cache,
        the empty rest of every reservation."""
        return self.kv_reserved_bytes - self.kv_used_bytes

    @property
    def wall_dt(self) -> float:
        return self.wall_end - self.wall_start


@dataclass
class Trace:
    """The steps of a run, in order: ``trace[k]`` is step ``k``.

    ``max_steps`` bounds the memory of a long-running server: the trace then
    keeps (at least) its last ``max_steps`` steps and counts the ones it let go
    in ``num_dropped``. Positions are then within what is kept (``trace[0]`` is
    step ``num_dropped``), so the per-request metrics, which look steps up by
    number, need the whole trace (the default, ``max_steps=None``)."""
    steps: list[StepRecord] = field(default_factory=list)
    max_steps: int | None = None
    num_dropped: int = 0

    def __post_init__(self):
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 1):
            raise ValueError(f"max_steps must be None or an integer >= 1, got {self.max_steps!r}")

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i):
        return self.steps[i]

    def append(self, rec: StepRecord) -> None:
        self.steps.append(rec)
        if self.max_steps is not None and len(self.steps) >= self.max_steps + max(1, self.max_steps // 8):
            extra = len(self.steps) - self.max_steps     # trimmed in batches: one list move per max/8 steps
            del self.steps[:extra]
            self.num_dropped += extra

    def column(self, name: str) -> np.ndarray:
        return np.array([getattr(s, name) for s in self.steps])

    # --- efficiency -----------------------------------------------------------
    @property
    def computed_tokens(self) -> int:
        return sum(s.computed_tokens for s in self.steps)

    @property
    def useful_tokens(self) -> int:
        return sum(s.useful_tokens for s in self.steps)

    def eta(self) -> float:
        """Useful tokens over computed tokens (padding included), for the whole run."""
        return self.useful_tokens / self.computed_tokens if self.computed_tokens else float("nan")

    def eta_by_batch(self) -> dict[int, float]:
        """eta of each static batch (steps carry their batch id)."""
        useful: dict[int, int] = {}
        computed: dict[int, int] = {}
        for s in self.steps:
            if s.batch_id is None:
                continue
            useful[s.batch_id] = useful.get(s.batch_id, 0) + s.useful_tokens
            computed[s.batch_id] = computed.get(s.batch_id, 0) + s.computed_tokens
        return {b: useful[b] / computed[b] for b in sorted(computed)}

    def acceptance_rate(self) -> float:
        """Accepted proposed tokens over proposed tokens, for the whole run."""
        proposed = sum(s.spec_proposed for s in self.steps)
        return sum(s.spec_accepted for s in self.steps) / proposed if proposed else float("nan")

    def mean_accepted_per_verification(self) -> float:
        """Proposed tokens accepted per verification (each also yields one target token)."""
        n = sum(s.num_verifications for s in self.steps)
        return sum(s.spec_accepted for s in self.steps) / n if n else float("nan")

    def end_time(self, clock: str = "wall") -> float:
        if not self.steps:
            return 0.0
        return getattr(self.steps[-1], f"{clock}_end") or 0.0

    def kv_utilization(self) -> float:
        """Time-averaged (per step) share of reserved KV bytes that hold real tokens."""
        reserved = self.column("kv_reserved_bytes").astype(float)
        used = self.column("kv_used_bytes").astype(float)
        ok = reserved > 0
        return float((used[ok] / reserved[ok]).mean()) if ok.any() else float("nan")
