"""The price of moving a request's KV cache from a prefill GPU to a decode GPU.

A transfer of ``b`` bytes over a link takes ``latency + b / bandwidth``. The
bandwidths are published peak figures, one direction, per GPU (each GPU sends
over its own link; with tensor parallelism each GPU sends its share):

* ``nvlink``: NVLink 4 on H100 SXM, 900 GB/s per GPU counting both
  directions, so 450 GB/s each way (NVIDIA's H100 datasheet); GPUs in one node.
* ``infiniband``: InfiniBand NDR, 400 Gb/s per port (NVIDIA ConnectX-7 /
  Quantum-2), one port per GPU as in a DGX H100: 50 GB/s each way; across nodes.
* ``pcie``: PCIe Gen5 x16, 32 GT/s per lane: about 64 GB/s each way (PCI-SIG);
  GPUs in one node without NVLink.

Real transfers reach less than the peak, so these prices are lower bounds.
The latencies are assumptions, not measurements: a few microseconds within a
node, ten across a network; next to the bandwidth term of a prompt's KV (a
megabyte or more) they hardly matter, as the chapter shows. A link carries one
transfer at a time (:class:`LinkQueue`): a prefill GPU's transfers queue
behind each other.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Link:
    """One GPU's link to another: one-way bandwidth (bytes/s) and a fixed latency (s)."""
    name: str
    bandwidth: float
    latency_s: float
    source: str

    def transfer_seconds(self, nbytes: float, num_gpus: int = 1) -> float:
        """Seconds to move ``nbytes`` (split over ``num_gpus`` GPUs' links in parallel)."""
        if nbytes < 0 or num_gpus < 1:
            raise ValueError(f"need nbytes >= 0 and num_gpus >= 1, got {nbytes}, {num_gpus}")
        return self.latency_s + nbytes / (self.bandwidth * num_gpus)


LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 450 * GB, 5e-6,
                   "NVIDIA H100 datasheet: NVLink 4, 900 GB/s per GPU (both directions); latency assumed"),
    "infiniband": Link("infiniband", 50 * GB, 10e-6,
                       "InfiniBand NDR (ConnectX-7): 400 Gb/s per port; latency assumed"),
    "pcie": Link("pcie", 64 * GB, 10e-6,
                 "PCIe Gen5 x16: 32 GT/s per lane, ~64 GB/s each way; latency assumed"),
}


def get_link(name: str | Link) -> Link:
    """A link by name (:data:`LINKS`), or ``name`` itself."""
    if isinstance(name, Link):
        return name
    try:
        return LINKS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown link {name!r}; known: {', '.join(LINKS)}") from None


class LinkQueue:
    """One link per sending GPU, one transfer at a time each: a transfer starts
    when its KV is ready and the link is free."""

    def __init__(self, link: Link, num_gpus: int = 1):
        self.link, self.num_gpus = link, num_gpus
        self.free_at: dict[int, float] = {}
        self.busy_s = 0.0

    def send(self, sender: int, ready_at: float, nbytes: float) -> float:
        """When ``nbytes`` sent from ``sender`` at ``ready_at`` have arrived."""
        start = max(ready_at, self.free_at.get(sender, 0.0))
        seconds = self.link.transfer_seconds(nbytes, self.num_gpus)
        self.busy_s += seconds
        self.free_at[sender] = start + seconds
        return start + seconds
