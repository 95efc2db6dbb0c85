"""What a deployment costs: GPU-hour prices and the cost of a million output tokens.

A deployment that meets its SLO serves its whole offered load, so its cost
per million output tokens is its GPUs' price per second over the output
tokens it serves per second:

    USD / Mtok = GPUs x (USD per GPU-hour / 3600) / (output tokens/s) x 1e6

The default prices are public on-demand list prices of specialist GPU clouds,
per GPU-hour. Cloud prices move by the month and differ by a factor of two
to three between providers (hyperscalers charge the most), so pass your own
(``--gpu-hour-usd``). They were read from a price survey, not from the
providers' own pages, which this project cannot reach offline.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..sim.hardware import get_gpu

PRICE_SOURCE = ("Mercatus, 'Cloud GPU pricing' (May 2026), https://www.mercatus-ai.com/blog/cloud-gpu-pricing: "
                "on-demand USD per GPU-hour at specialist clouds, the middle of its range "
                "(A100 80GB $1.10-1.50, H100 SXM5 $2.50-3.50, H200 SXM5 $3.50-4.50; hyperscalers "
                "list $1.50-3.00, $3.50-5.00 and $4.50-7.00). Not checked against the providers' own pages.")


@dataclass(frozen=True)
class GpuPrice:
    """A GPU-hour price in US dollars, and where it comes from."""
    usd_per_gpu_hour: float
    source: str


# GPU name (as in sim/hardware.py) -> the default price
GPU_HOUR_USD: dict[str, GpuPrice] = {
    "A100-80GB": GpuPrice(1.30, PRICE_SOURCE),
    "H100-SXM": GpuPrice(3.00, PRICE_SOURCE),
    "H200": GpuPrice(4.00, PRICE_SOURCE),
}


def gpu_hour_price(gpu: str, usd_per_gpu_hour: float | None = None) -> GpuPrice:
    """The price of one hour of ``gpu``: ``usd_per_gpu_hour`` when given (the
    user's own), else the cited default."""
    name = get_gpu(gpu).name                          # refuses an unknown GPU, naming the known ones
    if usd_per_gpu_hour is not None:
        if not (math.isfinite(usd_per_gpu_hour) and usd_per_gpu_hour > 0):
            raise ValueError(f"gpu_hour_usd must be a finite price > 0, got {usd_per_gpu_hour!r}")
        return GpuPrice(float(usd_per_gpu_hour), "given by the user")
    if name not in GPU_HOUR_USD:
        raise ValueError(f"no default price for {name}; pass gpu_hour_usd (--gpu-hour-usd)")
    return GPU_HOUR_USD[name]


def cost_per_million_tokens(num_gpus: int, usd_per_gpu_hour: float, tokens_per_s: float) -> float:
    """US dollars per million tokens for ``num_gpus`` GPUs at ``usd_per_gpu_hour``
    each, serving ``tokens_per_s`` tokens per second."""
    if num_gpus < 1 or not tokens_per_s > 0:
        raise ValueError(f"need num_gpus >= 1 and tokens_per_s > 0, got {num_gpus} and {tokens_per_s}")
    return num_gpus * usd_per_gpu_hour / 3600 / tokens_per_s * 1e6
