"""Model runners: the real model (ModelRunner) or a cost model only (SimRunner)."""
from .base import Runner
from .model_runner import ModelRunner
from .sim_runner import SimRunner

__all__ = ["Runner", "ModelRunner", "SimRunner"]
