"""Pipeline parallelism: the model's layers cut into stages on different GPUs,
and the schedule of micro-batches through them.

With ``pp`` stages, stage ``s`` holds a contiguous run of layers (the first
also the embedding, the last the final norm and the LM head) on its own
``tp`` GPUs. A batch is cut into micro-batches; each goes through the stages
in order, and between two stages its activations are handed over by a
point-to-point send (:func:`~.operators.send_recv_time`). A stage works on one
micro-batch at a time, so a stage waiting for its input sits idle: the
*bubble*.

Two schedules, both computed exactly from the per-(stage, micro-batch)
seconds by the earliest-start recurrence (a stage starts a micro-batch when it
has finished the previous one and the input has arrived):

* ``"gpipe"`` (GPipe, Huang et al. 2019): one batch of ``m`` micro-batches
  fills the pipeline and drains it. With equal stages of ``t`` seconds and free
  hand-overs it takes ``(m + pp - 1) t``, so a fraction ``(pp - 1) / (m + pp - 1)``
  of the GPUs' time is bubble (:func:`gpipe_bubble_fraction`).
* ``"steady"`` (vLLM's virtual engines): ``m`` micro-batches stay in flight
  step after step; micro-batch ``j``'s next token enters stage 0 as soon as
  its sampled ids come back from the last stage. The period is that of the
  repeating schedule (once three cycles in a row take the same time, else
  averaged over the second half of the repetitions): the busiest stage's work,
  ``sum_j t[s][j]``, or one micro-batch's round trip through every stage and
  hand-over, whichever binds. With ``m >= pp`` balanced micro-batches and
  free hand-overs there is no bubble; one lone sequence (``m = 1``) leaves
  ``(pp - 1) / pp`` of the GPUs idle.

The engine's loop is synchronous: one step advances every running sequence
by one token. It is priced with ``"steady"`` and ``m = min(pp, sequences)``
micro-batches, as vLLM runs ``pp`` virtual engines: a step's time is the
period of that step repeated (consecutive decode steps differ by one token
per sequence; a step with a prefill chunk is priced as if it recurred).

What that means for latency and throughput: a token (TPOT, and the step that
ends TTFT) waits for a full trip through every stage, about what one
``tp``-GPU group would take over all the layers for that micro-batch, plus
the hand-overs. Pipeline parallelism therefore does not shorten a step the
way tensor parallelism does. It adds memory (weights split ``pp`` ways, so
more KV and larger batches) and compute for prefills, and its communication
is small: one hand-over of the activations per stage boundary (the hidden
states and the residual, ``[tokens, hidden]`` each in bf16), where tensor
parallelism all-reduces twice per layer. Across nodes that is what makes it
the cheaper split; its throughput gains come from the larger batches.

Layers that do not divide evenly: each stage gets ``layers // pp`` and the
remainder goes one each to the stages before the last, from the last but one
backwards (the last also holds the LM head), as vLLM's default partition
does (its ``get_pp_indices`` tests: 5 layers on 3 stages are 2, 2, 1).
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("steady", "gpipe")
HANDOVER_TENSORS = 2   # vLLM's Llama hands over the hidden states and the residual, both [tokens, hidden]
SETTLE_CYCLES = 8      # steady state: at most this many repetitions per (stage + micro-batch) to settle


def check_pipeline_parallel(num_layers: int, pp: int) -> None:
    """``pp`` must be a positive integer no larger than the layers it splits."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers "
                         "(each stage needs at least one)")


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage: ``num_layers // pp`` each, the remainder one each to the
    stages before the last, from the last but one backwards."""
    check_pipeline_parallel(num_layers, pp)
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        counts[(pp - 2 - i) % pp] += 1
    return tuple(counts)


def handover_crosses_nodes(stage: int, tp: int, gpus_per_node: int) -> bool:
    """Whether the hand-over from ``stage`` to ``stage + 1`` leaves a node, with
    stages placed in order on consecutive GPUs (stage ``s`` on GPUs ``s tp`` to
    ``(s + 1) tp - 1``) and GPU ``i`` of one stage sending to GPU ``i`` of the next."""
    return any((stage * tp + i) // gpus_per_node != ((stage + 1) * tp + i) // gpus_per_node for i in range(tp))


def split_microbatches(shapes: list[tuple[int, int]], m: int) -> list[list[tuple[int, int]]]:
    """``shapes`` (sequences as (new tokens, context)) cut into ``m`` micro-batches
    balanced by new tokens, then context: the largest first, each to the lightest
    micro-batch so far (longest-processing-time first). Empty ones are dropped."""
    bins: list[list[tuple[int, int]]] = [[] for _ in range(m)]
    load = [(0, 0)] * m
    for q, n in sorted(shapes, key=lambda s: (-s[0], -s[1])):
        j = min(range(m), key=lambda i: load[i])
        bins[j].append((q, n))
        load[j] = (load[j][0] + q, load[j][1] + n)
    return [b for b in bins if b]


def gpipe_bubble_fraction(pp: int, microbatches: int) -> float:
    """The idle share of ``pp`` equal stages running ``microbatches`` equal
    micro-batches once (GPipe), hand-overs free: ``(pp - 1) / (m + pp - 1)``."""
    return (pp - 1) / (microbatches + pp - 1)


@dataclass(frozen=True)
class PipelineTiming:
    """One step through the pipeline.

    ``seconds``: the step (GPipe: fill to drain; steady: the period).
    ``stage_busy``: each stage's computing seconds in it. ``handover_seconds``:
    each boundary's sends, summed over the micro-batches (they travel while the
    stages compute; they cost time only when a stage waits for one).
    ``microbatches``, ``schedule``: what was run."""
    seconds: float
    stage_busy: tuple[float, ...]
    handover_seconds: tuple[float, ...]
    microbatches: int
    schedule: str

    @property
    def bubble_fraction(self) -> float:
        """Share of the stages' GPU time spent idle in the step."""
        if self.seconds <= 0:
            return 0.0
        return 1 - sum(self.stage_busy) / (len(self.stage_busy) * self.seconds)


def pipeline_time(stage_seconds, handover_seconds=None, return_seconds=None,
                  schedule: str = "steady") -> PipelineTiming:
    """Time the schedule: ``stage_seconds[s][j]`` is micro-batch ``j`` on stage
    ``s``; ``handover_seconds[s][j]`` its send from stage ``s`` to ``s + 1``
    (``pp - 1`` rows; default free); ``return_seconds[j]`` the sampled ids' trip
    from the last stage back to the first (default free; GPipe waits for it too)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    t = [list(map(float, row)) for row in stage_seconds]
    pp, m = len(t), len(t[0]) if t else 0
    if pp == 0 or m == 0 or any(len(row) != m for row in t):
        raise ValueError("stage_seconds must be a non-empty [stages][micro-batches] table")
    h = [list(map(float, row)) for row in handover_seconds] if handover_seconds is not None else \
        [[0.0] * m for _ in range(pp - 1)]
    if len(h) != pp - 1 or any(len(row) != m for row in h):
        raise ValueError(f"handover_seconds must be a [{pp - 1}][{m}] table (one row per stage boundary)")
    r = list(map(float, return_seconds)) if return_seconds is not None else [0.0] * m
    if len(r) != m:
        raise ValueError(f"return_seconds must have one entry per micro-batch ({m})")
    busy = tuple(sum(row) for row in t)
    sends = tuple(sum(row) for row in h)
    cycles = 1 if schedule == "gpipe" else SETTLE_CYCLES * (pp + m)
    ready = [0.0] * m            # when micro-batch j's input may enter stage 0
    free = [0.0] * pp            # when stage s is done with its previous micro-batch
    ends = []
    for _ in range(cycles):
        for j in range(m):
            arrive = ready[j]
            for s in range(pp):
                free[s] = max(free[s], arrive) + t[s][j]
                arrive = free[s] + (h[s][j] if s < pp - 1 else r[j])
            ready[j] = arrive
        ends.append(max(ready))
        steps = [b - a for a, b in zip(ends[-4:], ends[-3:])]
        if schedule == "steady" and len(ends) >= 4 and max(steps) - min(steps) <= 1e-12 * ends[-1]:
            return PipelineTiming(steps[-1], busy, sends, m, schedule)     # settled: each cycle the same
    if schedule == "gpipe":
        return PipelineTiming(ends[0], busy, sends, m, schedule)
    half = cycles // 2
    period = (ends[-1] - ends[half - 1]) / (cycles - half)
    return PipelineTiming(period, busy, sends, m, schedule)
