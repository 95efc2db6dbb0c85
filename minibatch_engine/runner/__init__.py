"""Model runners: the real model (ModelRunner) or a cost model only (SimRunner);
the persistent batch (input_batch), CUDA graphs, prepacked weights, the flat CPU
forward (flat_forward), the CPU thread count the runner sets when it is built
(cpu_threads), and glibc's malloc thresholds it raises on a CPU (cpu_memory)."""
from .base import Runner
from .model_runner import ModelRunner
from .sim_runner import SimRunner

__all__ = ["Runner", "ModelRunner", "SimRunner"]
