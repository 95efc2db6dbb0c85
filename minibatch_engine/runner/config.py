"""The model runner's knobs (composed by ``EngineConfig``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..attention.registry import BACKENDS
from ..core.checks import check_bool, check_choice, check_int


@dataclass(frozen=True)
class RunnerConfig:
    """Which attention backend runs, whether decode steps replay CUDA graphs, and
    how many CPU threads a forward uses (see :class:`~minibatch_engine.config.EngineConfig`)."""
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    cpu_threads: int | str = "auto"
    cpu_threads_follow_load: bool = True

    def __post_init__(self):
        check_choice("attention_backend", self.attention_backend, BACKENDS)
        check_bool("cuda_graphs", self.cuda_graphs)
        check_bool("cpu_threads_follow_load", self.cpu_threads_follow_load)
        if self.cpu_threads != "auto":
            check_int("cpu_threads", self.cpu_threads, 1)
