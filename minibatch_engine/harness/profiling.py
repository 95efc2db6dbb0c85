"""Where a run's time goes: attention, the rest of the model, and the engine itself.

Every step's wall time splits three ways (chapter 10, and the engine row of
``bench --vs-transformers``):

* **attention**: what the attention backend does in the step, wherever it does
  it: its ``build_metadata`` (once per step, on the host, while the runner
  prepares the inputs: the reference backend's padded layouts and masks, the
  sdpa backend's length buckets) and its ``forward`` calls (once per layer,
  inside the model), both timed from the inside while the run lasts
  (:func:`timed_attention`);
* **the rest of the model**: the runner's forward and sampling (the trace's
  ``forward_s + sample_s``) minus the attention calls: linear layers, norms,
  RoPE, sampling;
* **the engine**: what is left of the step: scheduling, building the inputs
  (less the attention metadata), bookkeeping, the trace. vLLM calls it the CPU
  overhead of a step; at a large batch it is the share that grows with the
  number of requests and not with the model.

One-time work is kept out of the split: :func:`profile_run` builds (or loads)
the C++ CPU kernels before the run starts, so the first run of a process does
not book half a minute of compiling as its first forward.

At a small batch the split that matters is finer: :func:`step_anatomy` takes
the decode steps of a trace apart into the phases the trace times (the
scheduler's decision, building the inputs, the forward, sampling, the
scheduler's update) and the rest (the engine's bookkeeping between them),
and :func:`decode_anatomy` measures it at several batch sizes.

Wall clock on a shared machine: shares move from run to run, so report them
measured side by side, never as typed constants.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

from ..sampling.params import SamplingParams


@dataclass
class TimeShares:
    """The split of a run's step time (seconds; the shares are properties)."""
    num_steps: int
    step_s: float            # sum of the steps' wall times
    model_s: float           # forward + sampling, attention's calls included
    attention_s: float       # inside the attention backend's forward calls (nan if not timed)
    big_steps: int           # decode-only steps with at least ``min_running`` requests
    big_step_s: float
    big_engine_s: float      # the engine's time in those steps (attention metadata left out)
    big_requests: int        # requests summed over those steps
    min_running: int = 48    # what counts as a large batch
    metadata_s: float = 0.0  # inside the backend's build_metadata (part of the runner's prepare_s)

    @property
    def attention(self) -> float:
        """The backend's share: its metadata and its forward calls."""
        return (self.attention_s + self.metadata_s) / self.step_s

    @property
    def rest_of_model(self) -> float:
        return (self.model_s - self.attention_s) / self.step_s

    @property
    def engine(self) -> float:
        return 1 - (self.model_s + self.metadata_s) / self.step_s

    @property
    def engine_at_large_batch(self) -> float:
        """The engine's share in the decode-only steps of a large batch (nan: none ran)."""
        return self.big_engine_s / self.big_step_s if self.big_steps else float("nan")

    @property
    def engine_us_per_request(self) -> float:
        """Engine microseconds per running request per step, in those steps."""
        return self.big_engine_s / self.big_requests * 1e6 if self.big_steps else float("nan")

    def as_dict(self) -> dict:
        return {"steps": self.num_steps, "step_seconds": self.step_s, "attention": self.attention,
                "attention_metadata": self.metadata_s / self.step_s,
                "rest_of_model": self.rest_of_model, "engine": self.engine,
                "large_batch_min_running": self.min_running, "large_batch_steps": self.big_steps,
                "engine_at_large_batch": self.engine_at_large_batch,
                "engine_us_per_request": self.engine_us_per_request}


@contextmanager
def timed_attention(engine, only=None):
    """Time what ``engine``'s attention backend does while the block runs.

    Yields a dict. Its ``"seconds"``, ``"calls"`` and ``"context_tokens"`` (the
    tokens the counted calls attend to, summed over calls: one layer's K/V read
    each) grow with each ``forward`` call; ``"metadata_seconds"`` with each
    ``build_metadata`` call, and ``"metadata_by_step"`` maps the index the step
    will have in ``engine.trace`` to its metadata seconds. ``only(meta)``, if
    given, picks the calls that count (say, decode steps: ``lambda meta:
    meta.max_query_len == 1``). The backend is restored after."""
    backend = getattr(engine.runner, "attention", None)
    if backend is None:
        raise ValueError("this engine has no attention backend to time (a simulator run has no model)")
    inner, inner_meta = backend.forward, backend.build_metadata
    spent = {"seconds": 0.0, "calls": 0, "context_tokens": 0, "metadata_seconds": 0.0,
             "metadata_by_step": {}}

    def forward(q, k, v, meta, *caches):
        t0 = time.perf_counter()
        out = inner(q, k, v, meta, *caches)
        if only is None or only(meta):
            spent["seconds"] += time.perf_counter() - t0
            spent["calls"] += 1
            spent["context_tokens"] += int(meta.seq_lens.sum())
        return out

    def build_metadata(*args, **kwargs):
        t0 = time.perf_counter()
        meta = inner_meta(*args, **kwargs)
        if only is None or only(meta):
            dt = time.perf_counter() - t0
            spent["metadata_seconds"] += dt
            step = len(engine.trace)       # the step being prepared is recorded next
            spent["metadata_by_step"][step] = spent["metadata_by_step"].get(step, 0.0) + dt
        return meta

    wrapped = {name: vars(backend).get(name) for name in ("forward", "build_metadata")}
    backend.forward, backend.build_metadata = forward, build_metadata   # instance attributes, undone below
    try:
        yield spent
    finally:
        for name, before in wrapped.items():    # another timer's, when timers nest
            if before is None:
                delattr(backend, name)
            else:
                setattr(backend, name, before)


def _build_one_time_kernels(engine) -> None:
    """Build (or load) the C++ CPU kernels now, before anything is timed: the
    fused small ops load them at their first call, inside the first forward."""
    runner = getattr(engine, "runner", None)
    if getattr(getattr(runner, "device", None), "type", None) == "cpu":
        from ..attention.cpu_kernel import cpu_kernel_or_none
        cpu_kernel_or_none()


def time_shares(trace, attention_s: float = float("nan"), min_running: int = 48,
                metadata_by_step: dict[int, float] | None = None) -> TimeShares:
    """Split the steps of ``trace`` (a real model's run) into attention, rest of
    model and engine; ``attention_s`` (the backend's forward calls) and
    ``metadata_by_step`` (its metadata, by step index) come from
    :func:`timed_attention`."""
    steps = trace.steps
    if not steps:
        raise ValueError("the trace has no steps: run the engine first")
    meta = metadata_by_step or {}
    big = [k for k, st in enumerate(steps) if st.prefill_tokens == 0 and st.num_scheduled >= min_running]
    big_step = sum(steps[k].wall_dt for k in big)
    return TimeShares(
        num_steps=len(steps), step_s=sum(st.wall_dt for st in steps),
        model_s=sum(st.forward_s + st.sample_s for st in steps), attention_s=attention_s,
        big_steps=len(big), big_step_s=big_step,
        big_engine_s=big_step - sum(steps[k].forward_s + steps[k].sample_s + meta.get(k, 0.0) for k in big),
        big_requests=sum(steps[k].num_scheduled for k in big), min_running=min_running,
        metadata_s=sum(meta.values()))


def profile_run(engine) -> TimeShares:
    """Run ``engine`` to the end with its attention backend timed; return the split.
    The C++ CPU kernels are built (or loaded) first, so no step pays for that."""
    _build_one_time_kernels(engine)
    with timed_attention(engine) as spent:
        engine.run()
    return time_shares(engine.trace, spent["seconds"], metadata_by_step=spent["metadata_by_step"])


PHASES = ("schedule", "prepare", "forward", "sample", "update", "rest")


@dataclass(frozen=True)
class StepAnatomy:
    """Mean microseconds of each phase of a group of decode steps (``us``, keyed by
    :data:`PHASES`); ``rest`` is the engine's bookkeeping: the runner's loops and
    block copies, building the trace record, the gap to the next step."""
    num_running: int
    num_steps: int
    us: dict[str, float]

    @property
    def step_us(self) -> float:
        return sum(self.us.values())

    @property
    def host_us(self) -> float:
        """Everything but the forward: the host's work around the model."""
        return self.step_us - self.us["forward"]

    def share(self, phase: str) -> float:
        return self.us[phase] / self.step_us


def step_anatomy(trace) -> dict[int, StepAnatomy]:
    """The decode-only steps of ``trace``, grouped by the number of requests they
    ran, taken apart into :data:`PHASES`. A step's whole cost runs from its start
    to the next step's start (so the record it leaves behind counts); the last
    step, which has no next, is left out."""
    groups: dict[int, list[dict[str, float]]] = {}
    steps = trace.steps
    for st, nxt in zip(steps, steps[1:]):
        if st.prefill_tokens or st.num_verifications or not st.num_scheduled:
            continue
        timed = {"schedule": st.schedule_s, "prepare": st.prepare_s, "forward": st.forward_s,
                 "sample": st.sample_s, "update": st.update_s}
        timed["rest"] = (nxt.wall_start - st.wall_start) - sum(timed.values())
        groups.setdefault(st.num_scheduled, []).append(timed)
    return {n: StepAnatomy(n, len(g), {p: sum(t[p] for t in g) / len(g) * 1e6 for p in PHASES})
            for n, g in sorted(groups.items())}


def decode_anatomy(make_engine: Callable[[int], object], batch_sizes: Sequence[int] = (1, 4, 16, 64),
                   prompt_len: int = 32, decode_steps: int = 64, rounds: int = 3) -> dict[int, StepAnatomy]:
    """:func:`step_anatomy` of steady decoding at each batch size: ``make_engine(b)``
    gives an engine, which is sent ``b`` requests of ``prompt_len`` tokens
    (greedy, no EOS) and run to the end: a prefill step, then ``decode_steps``
    decode steps of all ``b`` that count, and a last one (no next step starts
    after it, so it has no whole cost).
    The sizes are measured in ``rounds`` alternating rounds and each phase keeps
    its median over rounds, so a burst of load on a shared machine moves one
    round, not the result."""
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes!r}")
    if rounds < 1 or prompt_len < 1 or decode_steps < 1:
        raise ValueError(f"rounds, prompt_len and decode_steps must be >= 1, got {rounds}, {prompt_len}, "
                         f"{decode_steps}")
    params = SamplingParams(max_tokens=decode_steps + 2, ignore_eos=True, temperature=0.0)
    prompt = [1 + i % 200 for i in range(prompt_len)]
    measured: dict[int, list[StepAnatomy]] = {b: [] for b in batch_sizes}
    for _ in range(rounds):
        for b in batch_sizes:
            engine = make_engine(b)
            for _ in range(b):
                engine.add_request(prompt, params)
            engine.run()
            full = step_anatomy(engine.trace).get(b)
            if full is None:
                raise ValueError(f"no decode step ran all {b} requests: is max_num_seqs below {b}?")
            measured[b].append(full)
    out = {}
    for b, runs in measured.items():
        mid = {p: sorted(r.us[p] for r in runs)[len(runs) // 2] for p in PHASES}
        out[b] = StepAnatomy(b, sum(r.num_steps for r in runs), mid)
    return out
