"""Where a run's time goes: attention, the rest of the model, and the engine itself.

Every step's wall time splits three ways (chapter 10, and the engine row of
``bench --vs-transformers``):

* **attention**: the time inside the attention backend's ``forward`` calls,
  timed from the inside while the run lasts (:func:`timed_attention`);
* **the rest of the model**: the runner's forward and sampling (the trace's
  ``forward_s + sample_s``) minus attention: linear layers, norms, RoPE,
  sampling;
* **the engine**: what is left of the step: scheduling, building the inputs and
  the attention metadata, bookkeeping, the trace. vLLM calls it the CPU
  overhead of a step; at a large batch it is the share that grows with the
  number of requests and not with the model.

Wall clock on a shared machine: shares move from run to run, so report them
measured side by side, never as typed constants.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class TimeShares:
    """The split of a run's step time (seconds; the shares are properties)."""
    num_steps: int
    step_s: float            # sum of the steps' wall times
    model_s: float           # forward + sampling, attention included
    attention_s: float       # inside the attention backend (nan if not timed)
    big_steps: int           # decode-only steps with at least ``min_running`` requests
    big_step_s: float
    big_engine_s: float
    big_requests: int        # requests summed over those steps
    min_running: int = 48    # what counts as a large batch

    @property
    def attention(self) -> float:
        return self.attention_s / self.step_s

    @property
    def rest_of_model(self) -> float:
        return (self.model_s - self.attention_s) / self.step_s

    @property
    def engine(self) -> float:
        return 1 - self.model_s / self.step_s

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
                "rest_of_model": self.rest_of_model, "engine": self.engine,
                "large_batch_min_running": self.min_running, "large_batch_steps": self.big_steps,
                "engine_at_large_batch": self.engine_at_large_batch,
                "engine_us_per_request": self.engine_us_per_request}


@contextmanager
def timed_attention(engine, only=None):
    """Time every call of ``engine``'s attention backend while the block runs.

    Yields a dict whose ``"seconds"``, ``"calls"`` and ``"context_tokens"`` (the
    tokens the counted calls attend to, summed over calls: one layer's K/V read
    each) grow with each call; ``only(meta)``, if given, picks the calls that
    count (say, decode steps: ``lambda meta: meta.max_query_len == 1``). The
    backend is restored after."""
    backend = getattr(engine.runner, "attention", None)
    if backend is None:
        raise ValueError("this engine has no attention backend to time (a simulator run has no model)")
    inner, spent = backend.forward, {"seconds": 0.0, "calls": 0, "context_tokens": 0}

    def forward(q, k, v, meta, *caches):
        t0 = time.perf_counter()
        out = inner(q, k, v, meta, *caches)
        if only is None or only(meta):
            spent["seconds"] += time.perf_counter() - t0
            spent["calls"] += 1
            spent["context_tokens"] += int(meta.seq_lens.sum())
        return out

    wrapped = vars(backend).get("forward")     # another timer's, when timers nest
    backend.forward = forward                   # an instance attribute, undone below
    try:
        yield spent
    finally:
        if wrapped is None:
            del backend.forward
        else:
            backend.forward = wrapped


def time_shares(trace, attention_s: float = float("nan"), min_running: int = 48) -> TimeShares:
    """Split the steps of ``trace`` (a real model's run) into attention, rest of
    model and engine; ``attention_s`` comes from :func:`timed_attention`."""
    steps = trace.steps
    if not steps:
        raise ValueError("the trace has no steps: run the engine first")
    big = [st for st in steps if st.prefill_tokens == 0 and st.num_scheduled >= min_running]
    big_step = sum(st.wall_dt for st in big)
    return TimeShares(
        num_steps=len(steps), step_s=sum(st.wall_dt for st in steps),
        model_s=sum(st.forward_s + st.sample_s for st in steps), attention_s=attention_s,
        big_steps=len(big), big_step_s=big_step,
        big_engine_s=big_step - sum(st.forward_s + st.sample_s for st in big),
        big_requests=sum(st.num_scheduled for st in big), min_running=min_running)


def profile_run(engine) -> TimeShares:
    """Run ``engine`` to the end with its attention timed; return the split."""
    with timed_attention(engine) as spent:
        engine.run()
    return time_shares(engine.trace, spent["seconds"])
