"""Seeded synthetic workloads: prompt and output lengths from named distributions,
arrivals all at once, Poisson, or bursty (gamma-distributed gaps).

Two kinds of mix for scheduling policies (chapter 7):

* request classes (``"mixed-classes"``): an interactive class of short requests
  at high priority and a batch class of long ones, each with its own latency
  SLO;
* tenants (``clients={"a": 8, "b": 1}``): each client sends a Poisson stream at
  its own rate (requests/s), so one can flood the others.

Two workloads whose prompts share prefixes, for prefix caching and for routing
across replicas (chapter 12):

* ``"multi-turn"``: conversations; each turn's prompt is the whole history
  (earlier prompts and replies) plus a new user message;
* ``"system-prompts"``: a few long system prompts, one of them (the first ones
  more popular) ahead of each request's own user message.

Output lengths are honoured with ``ignore_eos`` (as serving benchmarks do), so
a workload fixes the schedule whatever tokens the model produces.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sampling.params import SamplingParams


class LengthDist:
    """A distribution of token counts; ``sample(rng, n)`` returns ``n`` ints."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError


@dataclass(frozen=True)
class Constant(LengthDist):
    value: int

    def sample(self, rng, n):
        return np.full(n, self.value, dtype=int)


@dataclass(frozen=True)
class Uniform(LengthDist):
    low: int
    high: int          # inclusive

    def sample(self, rng, n):
        return rng.integers(self.low, self.high + 1, size=n)


@dataclass(frozen=True)
class LogNormal(LengthDist):
    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng, n):
        x = rng.lognormal(np.log(self.median), self.sigma, size=n)
        return np.clip(np.round(x), self.low, self.high).astype(int)


@dataclass(frozen=True)
class Bimodal(LengthDist):
    """Mostly short, sometimes long: ``p_long`` of the draws come from ``long``."""
    short: LengthDist
    long: LengthDist
    p_long: float

    def sample(self, rng, n):
        is_long = rng.random(n) < self.p_long
        return np.where(is_long, self.long.sample(rng, n), self.short.sample(rng, n))


@dataclass(frozen=True)
class WorkloadSpec:
    prompt: LengthDist
    output: LengthDist
    description: str


WORKLOADS: dict[str, WorkloadSpec] = {
    "uniform": WorkloadSpec(Uniform(16, 128), Uniform(8, 256),
                            "prompts 16-128 tokens, outputs 8-256, uniform"),
    "fixed": WorkloadSpec(Constant(64), Constant(64), "every prompt 64 tokens, every output 64"),
    "lognormal": WorkloadSpec(Uniform(16, 128), LogNormal(48, 1.0, 4, 512),
                              "prompts 16-128 uniform, outputs lognormal (median 48, sigma 1, 4-512)"),
    "bimodal": WorkloadSpec(Uniform(16, 64), Bimodal(Uniform(8, 32), Uniform(256, 384), 0.2),
                            "prompts 16-64; outputs 80% short (8-32), 20% long (256-384)"),
    "chat": WorkloadSpec(LogNormal(96, 0.8, 8, 512), LogNormal(128, 0.7, 8, 448),
                         "chat-like: prompts lognormal (median 96), outputs lognormal (median 128)"),
}


@dataclass(frozen=True)
class RequestClass:
    """One class of a mixed workload: a share of the requests, their lengths, their
    priority (lower runs first) and their latency targets (SLO, seconds; None: none)."""
    name: str
    share: float
    prompt: LengthDist
    output: LengthDist
    priority: int
    slo_ttft_s: float | None
    slo_e2e_s: float | None


CLASS_WORKLOADS: dict[str, tuple[RequestClass, ...]] = {
    "mixed-classes": (
        RequestClass("interactive", 0.75, Uniform(16, 96), Uniform(8, 48), 0, slo_ttft_s=0.25, slo_e2e_s=1.0),
        RequestClass("batch", 0.25, Uniform(384, 640), Uniform(192, 320), 1, slo_ttft_s=5.0, slo_e2e_s=20.0),
    ),
}
# SLO of requests that belong to no class (the tenants of a multi-client workload).
DEFAULT_SLO_TTFT_S, DEFAULT_SLO_E2E_S = 0.5, 10.0


@dataclass
class RequestSpec:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0                  # lower runs first (policy="priority")
    client_id: str | None = None       # the tenant (policy="fair")
    request_class: str | None = None   # the class of a mixed workload, for reports

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)


def arrival_gaps(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """``n`` gaps between arrivals at a mean of ``rate`` requests per second.

    The gaps are gamma-distributed with shape ``burstiness`` and mean ``1/rate``
    (vLLM's ``--burstiness``): 1 gives exponential gaps, a Poisson process; below
    1 the gaps' coefficient of variation ``1/sqrt(burstiness)`` exceeds 1, so
    requests come in clumps separated by lulls; above 1 they come more evenly.
    """
    if not rate > 0:
        raise ValueError(f"arrival_rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1 = Poisson, smaller = burstier), got {burstiness}")
    if burstiness == 1:
        return rng.exponential(1.0 / rate, size=n)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)


def parse_clients(text: str) -> dict[str, float]:
    """``"a:8,b:1,c:1"`` -> ``{"a": 8.0, "b": 1.0, "c": 1.0}`` (requests/s per client)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, rate = part.strip().partition(":")
        try:
            value = float(rate)
        except ValueError:
            value = float("nan")
        if not sep or not name or not value > 0 or name in out:
            raise ValueError(f"--clients {text!r}: give distinct name:rate pairs with rates > 0 "
                             "(requests/s), e.g. a:8,b:1,c:1")
        out[name] = value
    return out


@dataclass(frozen=True)
class MultiTurnSpec:
    """Conversations of ``turns`` turns: the first user message, then a reply
    (``output``) and a next user message (``follow_up``) per turn. Conversations
    start at ``arrival_rate / mean turns`` per second (Poisson), from time 0,
    so the stream reaches ``arrival_rate`` once the first conversations have
    had their later turns (a few ``think_s``); a turn follows the one before
    after ``think_s`` seconds plus an exponential wait of mean ``think_s`` (the
    user reads, then types)."""
    turns: LengthDist = Uniform(2, 6)
    first: LengthDist = LogNormal(192, 0.6, 16, 1024)
    follow_up: LengthDist = LogNormal(48, 0.8, 4, 256)
    output: LengthDist = LogNormal(128, 0.6, 8, 384)
    think_s: float = 2.0
    description: str = ("multi-turn chat: 2-6 turns, each prompt the whole history; first message "
                        "lognormal (median 192), follow-ups (median 48), replies (median 128)")


@dataclass(frozen=True)
class SystemPromptSpec:
    """``num_prompts`` system prompts of ``system`` tokens; a request takes prompt
    ``i`` with weight ``1 / (i + 1)`` (a few popular ones), then its own user
    message (``user``) and asks for ``output`` tokens."""
    num_prompts: int = 4
    system: LengthDist = Uniform(1024, 2048)
    user: LengthDist = LogNormal(96, 0.8, 8, 512)
    output: LengthDist = LogNormal(128, 0.6, 8, 384)
    description: str = ("a few long system prompts: 4 of 1024-2048 tokens (weights 1, 1/2, 1/3, 1/4), "
                        "then a user message (median 96); outputs median 128")


PREFIX_WORKLOADS: dict[str, MultiTurnSpec | SystemPromptSpec] = {
    "multi-turn": MultiTurnSpec(),
    "system-prompts": SystemPromptSpec(),
}


def _tokens(rng, n: int, vocab_size: int) -> list[int]:
    return rng.integers(0, vocab_size, size=int(n)).tolist()


def _make_multi_turn(spec: MultiTurnSpec, num_requests, rng, vocab_size, arrival_rate) -> list[RequestSpec]:
    """The first ``num_requests`` turns of conversations, by arrival. A
    turn's prompt holds the earlier replies as the workload drew them (a
    simulated model's own tokens differ: a cache then holds the earlier
    prompts, not the replies)."""
    mean_turns = float(np.mean(spec.turns.sample(np.random.default_rng(0), 1000)))
    # Stop once num_requests turns have arrived by the latest conversation's
    # start: the turns taken are the first ones of the stream, none missing.
    start, out, conv = 0.0, [], 0
    while sum(s.arrival_time <= start for s in out) < num_requests:
        if arrival_rate is not None:
            start += float(rng.exponential(mean_turns / arrival_rate))
        history, t = _tokens(rng, spec.first.sample(rng, 1)[0], vocab_size), start
        for k in range(int(spec.turns.sample(rng, 1)[0])):
            if k:
                t += spec.think_s + float(rng.exponential(spec.think_s)) if arrival_rate is not None else 0.0
                history = history + reply + _tokens(rng, spec.follow_up.sample(rng, 1)[0], vocab_size)
            g = int(spec.output.sample(rng, 1)[0])
            out.append(RequestSpec(list(history), g, t, client_id=f"conv-{conv}"))
            reply = _tokens(rng, g, vocab_size)
        conv += 1
    out.sort(key=lambda s: s.arrival_time)
    return out[:num_requests]


def _make_system_prompts(spec: SystemPromptSpec, num_requests, rng, vocab_size, arrival_rate,
                         burstiness) -> list[RequestSpec]:
    systems = [_tokens(rng, n, vocab_size) for n in spec.system.sample(rng, spec.num_prompts)]
    w = 1.0 / np.arange(1, spec.num_prompts + 1)
    which = rng.choice(spec.num_prompts, size=num_requests, p=w / w.sum())
    users, outputs = spec.user.sample(rng, num_requests), spec.output.sample(rng, num_requests)
    arrivals = (np.cumsum(arrival_gaps(rng, num_requests, arrival_rate, burstiness))
                if arrival_rate is not None else np.zeros(num_requests))
    return [RequestSpec(systems[k] + _tokens(rng, u, vocab_size), int(g), float(t), request_class=f"system-{k}")
            for k, u, g, t in zip(which, users, outputs, arrivals)]


def workload_names() -> list[str]:
    return sorted([*WORKLOADS, *CLASS_WORKLOADS, *PREFIX_WORKLOADS])


def slo_of(spec: RequestSpec, workload: str) -> tuple[float | None, float | None]:
    """The (TTFT, E2E) targets in seconds of a request of ``workload``."""
    for c in CLASS_WORKLOADS.get(workload, ()):
        if c.name == spec.request_class:
            return c.slo_ttft_s, c.slo_e2e_s
    return DEFAULT_SLO_TTFT_S, DEFAULT_SLO_E2E_S


def _make_classes(classes, num_requests, rng, vocab_size, arrival_rate) -> list[RequestSpec]:
    shares = np.array([c.share for c in classes], dtype=float)
    which = rng.choice(len(classes), size=num_requests, p=shares / shares.sum())
    arrivals = (np.cumsum(rng.exponential(1.0 / arrival_rate, size=num_requests))
                if arrival_rate else np.zeros(num_requests))
    out = []
    for k, t in zip(which, arrivals):
        c = classes[k]
        p, g = int(c.prompt.sample(rng, 1)[0]), int(c.output.sample(rng, 1)[0])
        out.append(RequestSpec(rng.integers(0, vocab_size, size=p).tolist(), g, float(t),
                               priority=c.priority, request_class=c.name))
    return out


def _make_clients(spec, clients, num_requests, rng, vocab_size) -> list[RequestSpec]:
    """Each client a Poisson stream at its rate; the first ``num_requests`` arrivals
    of the merged streams."""
    arrivals = sorted((float(t), name) for name, rate in clients.items()
                      for t in np.cumsum(rng.exponential(1.0 / rate, size=num_requests)))[:num_requests]
    prompts, outputs = spec.prompt.sample(rng, num_requests), spec.output.sample(rng, num_requests)
    return [RequestSpec(rng.integers(0, vocab_size, size=int(p)).tolist(), int(g), t, client_id=name)
            for (t, name), p, g in zip(arrivals, prompts, outputs)]


def make_workload(name: str | WorkloadSpec, num_requests: int, seed: int = 0, vocab_size: int = 256,
                  arrival_rate: float | None = None, burstiness: float = 1.0,
                  clients: dict[str, float] | None = None, max_model_len: int | None = None) -> list[RequestSpec]:
    """``num_requests`` requests with lengths from the named workload.

    Prompt tokens are uniform over ``[0, vocab_size)``. ``arrival_rate`` (requests
    per second) spreads arrivals over time with gaps from :func:`arrival_gaps`
    (``burstiness`` 1: Poisson); ``None`` means all at time 0.
    A class workload (``"mixed-classes"``) draws each request's class by its
    share. A prefix workload (``"multi-turn"``, ``"system-prompts"``) builds
    prompts that share prefixes (:data:`PREFIX_WORKLOADS`); a multi-turn
    request's ``client_id`` names its conversation, a system-prompt request's
    ``request_class`` its system prompt. ``clients`` (name -> requests/s) makes a multi-tenant workload instead
    of ``arrival_rate``: lengths from ``name``, arrivals per client.
    A trace replay (:class:`~minibatch_engine.harness.request_traces.TraceWorkload`, any
    object with its ``make_requests``) makes its own requests; ``max_model_len``
    is the engine's limit, which it checks its lengths against.
    """
    if hasattr(name, "make_requests"):
        if clients:
            raise ValueError(f"a trace ({name}) has its own arrivals; --clients takes a length workload")
        return name.make_requests(num_requests, seed=seed, vocab_size=vocab_size, arrival_rate=arrival_rate,
                                  max_model_len=max_model_len)
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    if isinstance(name, str) and name in PREFIX_WORKLOADS:
        if clients:
            raise ValueError(f"workload {name!r} has its own streams; --clients takes a length workload "
                             f"({', '.join(WORKLOADS)})")
        spec = PREFIX_WORKLOADS[name]
        if isinstance(spec, MultiTurnSpec):
            return _make_multi_turn(spec, num_requests, rng, vocab_size, arrival_rate)
        return _make_system_prompts(spec, num_requests, rng, vocab_size, arrival_rate, burstiness)
    if isinstance(name, str) and name in CLASS_WORKLOADS:
        if clients:
            raise ValueError(f"workload {name!r} has classes; --clients takes a length workload "
                             f"({', '.join(WORKLOADS)})")
        return _make_classes(CLASS_WORKLOADS[name], num_requests, rng, vocab_size, arrival_rate)
    spec = WORKLOADS.get(name) if isinstance(name, str) else name
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(workload_names())}")
    if clients:
        if arrival_rate is not None:
            raise ValueError("give either arrival_rate or clients (each client has its own rate), not both")
        return _make_clients(spec, clients, num_requests, rng, vocab_size)
    prompts = spec.prompt.sample(rng, num_requests)
    outputs = spec.output.sample(rng, num_requests)
    arrivals = (np.cumsum(arrival_gaps(rng, num_requests, arrival_rate, burstiness))
                if arrival_rate is not None else np.zeros(num_requests))
    return [RequestSpec(rng.integers(0, vocab_size, size=int(p)).tolist(), int(g), float(t))
            for p, g, t in zip(prompts, outputs, arrivals)]
