"""Executors: the real model (TorchExecutor) or a cost model only (SimExecutor)."""
from .base import Executor, ExecutorOutput
from .sim_executor import SimExecutor
from .torch_executor import TorchExecutor

__all__ = ["Executor", "ExecutorOutput", "TorchExecutor", "SimExecutor"]
