"""Named GPUs for the roofline simulator, with the published figures they use.

Peak figures are dense (no sparsity) BF16/FP16 tensor-core throughput and HBM
bandwidth from NVIDIA's own datasheets. Real kernels reach a fraction of
both; the simulator states that assumption instead of hiding it in the peaks.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float          # dense BF16 FLOP/s
    hbm_bandwidth: float       # bytes/s
    memory_bytes: float
    host_link_bandwidth: float  # bytes/s, host <-> device (for swapping)
    nvlink_bandwidth: float     # bytes/s, GPU <-> GPU, each direction (tensor parallelism)
    source: str

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte at which the roofline turns from memory- to compute-bound."""
        return self.peak_flops / self.hbm_bandwidth


GB = 1e9
A100_80GB = GPU("A100-80GB", 312e12, 2039 * GB, 80 * GB, 32 * GB, 300 * GB,
                "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOPS BF16 dense, "
                "2,039 GB/s HBM2e; PCIe Gen4 x16 32 GB/s per direction; NVLink 600 GB/s (both directions)")
H100_SXM = GPU("H100-SXM", 989e12, 3350 * GB, 80 * GB, 64 * GB, 450 * GB,
               "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS BF16 dense "
               "(1,979 with sparsity), 3.35 TB/s HBM3; PCIe Gen5 x16 64 GB/s per direction; "
               "NVLink 900 GB/s (both directions)")
H200 = GPU("H200", 989e12, 4800 * GB, 141 * GB, 64 * GB, 450 * GB,
           "NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS BF16 dense, "
           "4.8 TB/s HBM3e, 141 GB; PCIe Gen5 x16 64 GB/s per direction; NVLink 900 GB/s (both directions)")

GPUS: dict[str, GPU] = {g.name.lower(): g for g in (A100_80GB, H100_SXM, H200)}


def get_gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(g.name for g in GPUS.values())}") from None
