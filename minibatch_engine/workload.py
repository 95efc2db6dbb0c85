"""Seeded synthetic workloads: prompt and output lengths from named distributions,
arrivals all at once, Poisson, or bursty (gamma-distributed gaps).

Output lengths are honoured with ``ignore_eos`` (as serving benchmarks do), so
a workload fixes the schedule whatever tokens the model produces.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sampling import SamplingParams


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


@dataclass
class RequestSpec:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0

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


def make_workload(name: str | WorkloadSpec, num_requests: int, seed: int = 0, vocab_size: int = 256,
                  arrival_rate: float | None = None, burstiness: float = 1.0) -> list[RequestSpec]:
    """``num_requests`` requests with lengths from the named workload.

    Prompt tokens are uniform over ``[0, vocab_size)``. ``arrival_rate`` (requests
    per second) spreads arrivals over time with gaps from :func:`arrival_gaps`
    (``burstiness`` 1: Poisson); ``None`` means all at time 0.
    """
    spec = WORKLOADS.get(name) if isinstance(name, str) else name
    if spec is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    prompts = spec.prompt.sample(rng, num_requests)
    outputs = spec.output.sample(rng, num_requests)
    arrivals = (np.cumsum(arrival_gaps(rng, num_requests, arrival_rate, burstiness))
                if arrival_rate is not None else np.zeros(num_requests))
    return [RequestSpec(rng.integers(0, vocab_size, size=int(p)).tolist(), int(g), float(t))
            for p, g, t in zip(prompts, outputs, arrivals)]
