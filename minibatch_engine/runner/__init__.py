"""Model runners: the real model (ModelRunner) or a cost model only (SimRunner);
the persistent batch (input_batch), CUDA graphs, prepacked weights, and the CPU
thread count the runner sets when it is built (cpu_threads)."""
from .base import Runner
from .model_runner import ModelRunner
from .sim_runner import SimRunner

__all__ = ["Runner", "ModelRunner", "SimRunner"]
