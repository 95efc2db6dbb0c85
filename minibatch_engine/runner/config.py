"""The model runner's knobs (composed by ``EngineConfig``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..attention.registry import BACKENDS
from ..checks import check_bool, check_choice


@dataclass(frozen=True)
class RunnerConfig:
    """Which attention backend runs, and whether decode steps replay CUDA graphs
    (see :class:`~minibatch_engine.config.EngineConfig`)."""
    attention_backend: str = "auto"
    cuda_graphs: bool = True

    def __post_init__(self):
        check_choice("attention_backend", self.attention_backend, BACKENDS)
        check_bool("cuda_graphs", self.cuda_graphs)
