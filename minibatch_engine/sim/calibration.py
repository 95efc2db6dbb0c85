"""The simulator's constants: fitted ones, read from ``calibration.json``, and
the assumptions no measurement here can fit, each named with its reason.

``tools/calibrate_sim.py`` fits the fitted ones on ``data/gpu-profiles/`` and
writes the JSON with its provenance (input files and their sha256, the date,
the errors on the calibration set and on held-out GPUs and shapes); a test
refits them and compares.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class Calibration:
    """Per-operator constants (see :mod:`.operators` for the formulas).

    Fitted: ``e_compute``, ``e_memory``, ``p``, ``t0_s`` (projections);
    ``small_ops`` (operator -> (efficiency, fixed seconds)); ``all_reduce``
    (GPU count or ``"shared"`` -> (alpha seconds, bus bandwidth as a fraction
    of the GPU's NVLink bandwidth)).

    Assumed (the profiles hold no attention kernel and no host time):

    * ``attention_e_compute``: prefill attention (FlashAttention-style, causal)
      at 0.5 of peak: FlashAttention-2 reports 50-73% of A100 peak in its
      forward pass and FlashAttention-3 up to 75% on H100, for long sequences;
      serving chunks are shorter, so the low end.
    * ``attention_e_memory``: decode attention reads the KV cache at 0.7 of
      HBM bandwidth (paged kernels lose some to block gathers and short contexts).
    * ``launch_s``: 10 us of CPU time per kernel launched from eager PyTorch
      (the Python and dispatcher work around the driver's few-microsecond
      launch); a CUDA graph replays a whole decode step for one ``graph_launch_s``.
    """
    e_compute: float
    e_memory: float
    p: float
    t0_s: float
    small_ops: dict[str, tuple[float, float]]
    all_reduce: dict[object, tuple[float, float]]
    send_recv: dict[str, tuple[float, float]] = field(default_factory=dict)
    attention_e_compute: float = 0.5
    attention_e_memory: float = 0.7
    launch_s: float = 10e-6
    graph_launch_s: float = 20e-6
    provenance: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def load(cls, path: str | Path = CALIBRATION_FILE) -> "Calibration":
        data = json.loads(Path(path).read_text())
        g = data["gemm"]
        ar = data["all_reduce"]
        all_reduce = {int(n): (v["alpha_s"], v["busbw_fraction"]) for n, v in ar["per_gpu_count"].items()}
        all_reduce["shared"] = (ar["shared"]["alpha_s"], ar["shared"]["busbw_fraction"])
        sr = data.get("send_recv", {})
        send_recv = {}
        if sr:
            send_recv = {"within_node": (sr["within_node"]["alpha_s"], sr["within_node"]["bandwidth_fraction"]),
                         "across_nodes": (sr["across_nodes"]["alpha_s"], sr["across_nodes"]["bandwidth_Bps"])}
        return cls(e_compute=g["e_compute"], e_memory=g["e_memory"], p=g["p"], t0_s=g["t0_s"],
                   small_ops={op: (v["e"], v["t0_s"]) for op, v in data["small_ops"].items()},
                   all_reduce=all_reduce, send_recv=send_recv, provenance=data.get("provenance", {}))


@functools.cache
def default_calibration() -> Calibration:
    """The committed constants (``calibration.json``), read once."""
    return Calibration.load()
