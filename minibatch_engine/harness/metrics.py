"""Latency and throughput metrics, with the names and definitions of vLLM's
serving benchmark (``vllm bench serve``).

Per request, in seconds of one clock (``wall``, or ``sim`` for the simulated GPU):

* queueing time: arrival -> the start of its first scheduled step;
* **TTFT** (time to first token): arrival -> the first output token;
* **E2EL** (end-to-end latency): arrival -> the last output token;
* **TPOT** (time per output token): ``(E2EL - TTFT) / (output tokens - 1)``,
  the decode speed one user sees, with the first token's wait left out. It is
  defined for requests of two or more output tokens; like vLLM, a request of
  one token counts as TPOT 0 for goodput and is left out of TPOT percentiles;
* **ITL** (inter-token latency): every gap between two consecutive output
  tokens. ITL percentiles pool the gaps of every request, so a request with
  500 tokens weighs 500 times more than one with 2; TPOT percentiles weigh each
  request once. (The mean of a request's gaps equals its TPOT; their spreads
  differ: one 1-second stall among 100 tokens moves p99 ITL, barely TPOT.)

Over a run of ``duration`` seconds (first arrival -> last token):

* **request throughput** = completed requests / duration;
* **output throughput** = output tokens / duration;
* **goodput** = requests that met *every* SLO given (TTFT, TPOT, E2EL, each
  ``<=`` its bound in ms) / duration: the rate of requests a user was happy
  with, as vLLM's benchmark reports it. (DistServe, Zhong et al., 2024, uses
  the word for the highest request rate at which a target share of requests
  meets its SLOs: see ``sweep.distserve_goodput``.)

In engine steps (this book's third clock), an event in step ``k`` of a request
that arrived before step ``a`` counts ``k - a + 1`` steps (the steps it lived
through).

What preemption by recompute costs in work (:func:`recompute_work`, chapters 6
and 7): the KV a preemption *discards* is not all computed again, since the prefix
cache can still hold the victim's freed full blocks when it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..core.request import Request
from ..core.trace import Trace

CLOCKS = ("wall", "sim")
SLO_METRICS = ("ttft", "tpot", "e2el")      # the names --goodput accepts (vLLM's)
DEFAULT_PERCENTILES = (50, 90, 99)


@dataclass
class RequestMetrics:
    """One request's latencies. A request that produced no token (aborted, or
    failed, before its first) has None for every token latency and empty
    ``itl_steps``/``seconds``; ``queue_steps`` is None if it was never scheduled."""
    num_prompt_tokens: int
    num_output_tokens: int
    queue_steps: int | None
    ttft_steps: int | None
    e2e_steps: int | None
    tpot_steps: float | None   # (e2e_steps - ttft_steps) / (n - 1); 0 for one token
    itl_steps: list            # gaps between consecutive tokens, in steps
    seconds: dict              # clock -> {"queue", "ttft", "e2e", "tpot", "itl"}


def tpot(e2el: float, ttft: float, num_output_tokens: int) -> float:
    """vLLM's TPOT: ``(E2EL - TTFT) / (n - 1)``; 0 for a single token."""
    return (e2el - ttft) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0


def _whole(trace: Trace) -> None:
    """Per-request metrics look steps up by number: they need the whole trace."""
    if getattr(trace, "num_dropped", 0):
        raise ValueError(f"this trace has let go of its first {trace.num_dropped} steps (Trace.max_steps): "
                         "per-request metrics need the whole trace")


def request_metrics(req: Request, trace: Trace) -> RequestMetrics:
    """Latencies of a request from the trace: a token's time is the end of the
    step that sampled it (None throughout for a request with no token)."""
    _whole(trace)
    a = req.arrival_step
    if not req.token_steps:
        queue = None if req.first_scheduled_step is None else req.first_scheduled_step - a
        return RequestMetrics(req.num_prompt_tokens, 0, queue, None, None, None, [], {})
    first, last = req.token_steps[0], req.token_steps[-1]
    n = len(req.token_steps)
    itl = list(np.diff(req.token_steps).tolist())
    sched = req.first_scheduled_step if req.first_scheduled_step is not None else first
    seconds = {}
    for clock in CLOCKS:
        if getattr(trace[first], f"{clock}_end") is None:
            continue
        end = lambda k: getattr(trace[k], f"{clock}_end")  # noqa: E731
        start = lambda k: getattr(trace[k], f"{clock}_start")  # noqa: E731
        t0 = req.arrival_time.get(clock, start(a) if a < len(trace) else 0.0)
        times = [end(k) for k in req.token_steps]
        ttft, e2e = times[0] - t0, times[-1] - t0
        seconds[clock] = {"queue": start(sched) - t0, "ttft": ttft, "e2e": e2e,
                          "tpot": tpot(e2e, ttft, n), "itl": np.diff(times).tolist()}
    ttft_steps, e2e_steps = first - a + 1, last - a + 1
    return RequestMetrics(
        num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
        queue_steps=sched - a, ttft_steps=ttft_steps, e2e_steps=e2e_steps,
        tpot_steps=tpot(e2e_steps, ttft_steps, n), itl_steps=itl, seconds=seconds)


@dataclass
class RequestTiming:
    """What a client sees of one request: when it was sent and when each output
    token came back (seconds, any one clock). Built from the trace
    (:func:`timings_from_trace`) or by a streaming client (``AsyncLLM``)."""
    arrival: float
    token_times: Sequence[float]
    num_prompt_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def tpot(self) -> float:
        return tpot(self.e2el, self.ttft, self.num_output_tokens)

    @property
    def itl(self) -> list[float]:
        return np.diff(np.asarray(self.token_times, dtype=float)).tolist()


def timings_from_trace(requests: Iterable[Request], trace: Trace, clock: str) -> list[RequestTiming]:
    """One :class:`RequestTiming` per request that produced a token."""
    _whole(trace)
    out = []
    for r in requests:
        if not r.token_steps:
            continue
        end = [getattr(trace[k], f"{clock}_end") for k in r.token_steps]
        if end[0] is None:
            raise ValueError(f"the trace has no {clock!r} clock (simulated times need sim_gpu)")
        a = r.arrival_time.get(clock)
        if a is None:
            a = getattr(trace[r.arrival_step], f"{clock}_start") if r.arrival_step < len(trace) else 0.0
        out.append(RequestTiming(a, end, r.num_prompt_tokens))
    return out


def _pkey(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def percentiles(values, ps=DEFAULT_PERCENTILES) -> dict[str, float]:
    """``{"p50": ..., "p99": ...}`` (NaN for no values)."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {_pkey(p): float("nan") for p in ps}
    return {_pkey(p): float(np.percentile(arr, p)) for p in ps}


def parse_percentiles(text: str | Sequence[float]) -> tuple[float, ...]:
    """``"50,90,99"`` (``--percentiles``) -> ``(50.0, 90.0, 99.0)``; each in [0, 100]."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        try:
            p = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"percentiles: {item!r} is not a number (give e.g. '50,90,99')") from None
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles: {p:g} is outside [0, 100]")
        out.append(p)
    if not out:
        raise ValueError("percentiles: give at least one, e.g. '50,90,99'")
    return tuple(out)


def parse_goodput(items: Sequence[str] | Mapping[str, float] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` (``--goodput``, vLLM's syntax: milliseconds) ->
    ``{"ttft": 200.0, "tpot": 50.0}``. A mapping is checked and returned."""
    if not items:
        return {}
    pairs = items.items() if isinstance(items, Mapping) else [
        tuple(s.split(":", 1)) if ":" in s else (s, None) for s in items]
    out = {}
    for name, value in pairs:
        if name not in SLO_METRICS:
            raise ValueError(f"goodput: unknown SLO {name!r}; give {', '.join(m + ':MS' for m in SLO_METRICS)}")
        try:
            ms = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"goodput: {name} needs a bound in milliseconds, as {name}:200, "
                             f"got {value!r}") from None
        if not ms > 0:
            raise ValueError(f"goodput: the {name} bound must be > 0 ms, got {ms:g}")
        out[name] = ms
    return out


def meets_slo(t: RequestTiming, slo_ms: Mapping[str, float]) -> bool:
    """Whether a request met every SLO (each value ``<=`` its bound)."""
    values = {"ttft": t.ttft, "tpot": t.tpot, "e2el": t.e2el}
    return all(values[k] * 1e3 <= bound for k, bound in slo_ms.items())


def serving_metrics(timings: Sequence[RequestTiming], duration: float | None = None,
                    ps: Sequence[float] = DEFAULT_PERCENTILES,
                    goodput: Mapping[str, float] | None = None) -> dict:
    """vLLM's benchmark numbers for completed requests, as flat keys:
    ``ttft_ms_{mean,p50,...}``, ``tpot_ms_*``, ``itl_ms_*``, ``e2el_ms_*``,
    ``completed``, ``duration_s``, ``request_throughput`` (req/s),
    ``output_throughput`` (tok/s), ``total_token_throughput`` (prompt + output
    tok/s) and, with SLOs (ms, see :func:`parse_goodput`), ``goodput`` (req/s)
    and ``good_requests``. ``duration`` defaults to first arrival -> last token."""
    slo = parse_goodput(goodput)
    if duration is None:
        duration = (max(t.token_times[-1] for t in timings) - min(t.arrival for t in timings)
                    if timings else 0.0)
    per = lambda x: x / duration if duration > 0 else float("nan")  # noqa: E731
    out_tokens = sum(t.num_output_tokens for t in timings)
    s = {"completed": len(timings), "duration_s": duration,
         "request_throughput": per(len(timings)), "output_throughput": per(out_tokens),
         "total_token_throughput": per(out_tokens + sum(t.num_prompt_tokens for t in timings))}
    series = {"ttft": [t.ttft for t in timings],
              "tpot": [t.tpot for t in timings if t.num_output_tokens > 1],
              "itl": [g for t in timings for g in t.itl],
              "e2el": [t.e2el for t in timings]}
    for name, vals in series.items():
        ms = np.asarray(vals, dtype=float) * 1e3
        s[f"{name}_ms_mean"] = float(ms.mean()) if ms.size else float("nan")
        s.update({f"{name}_ms_{k}": v for k, v in percentiles(ms, ps).items()})
    if slo:
        good = sum(meets_slo(t, slo) for t in timings)
        s.update({f"slo_{k}_ms": v for k, v in slo.items()})
        s["good_requests"] = good
        s["goodput"] = per(good)
    return s


@dataclass(frozen=True)
class RecomputeWork:
    """What preemption by recompute cost a run, in tokens.

    * ``discarded``: tokens whose K/V recompute preemptions threw away
      (``Request.num_recomputed_tokens``);
    * ``cache_hits``: tokens the prefix cache supplied at admission
      (``Request.num_cached_tokens``), mostly a victim's own freed blocks found
      again when it returns;
    * ``needed``: tokens a run computes with no preemption and no prefix cache,
      ``prompt + output - 1`` per request (the last sampled token is never fed back);
    * ``recomputed = discarded - cache_hits``: tokens computed beyond ``needed``.

    ``needed + recomputed`` is what the run scheduled (its trace's
    ``useful_tokens``) for requests that ran to the end without speculative tokens.
    When prompts share prefixes, the hits of first admissions count too, and
    ``recomputed`` is the run's work beyond a run without preemption and without
    a prefix cache (it can then be negative)."""
    discarded: int
    cache_hits: int
    needed: int

    @property
    def recomputed(self) -> int:
        return self.discarded - self.cache_hits

    @property
    def share(self) -> float:
        """``recomputed / needed``: the extra work, as a share of the run's own."""
        return self.recomputed / self.needed if self.needed else float("nan")


def recompute_work(requests: Iterable[Request]) -> RecomputeWork:
    """:class:`RecomputeWork` of finished requests (one sequence each)."""
    requests = list(requests)
    return RecomputeWork(
        discarded=sum(r.num_recomputed_tokens for r in requests),
        cache_hits=sum(r.num_cached_tokens for r in requests),
        needed=sum(r.num_prompt_tokens + r.num_output_tokens - 1
                   for r in requests if r.num_output_tokens))
