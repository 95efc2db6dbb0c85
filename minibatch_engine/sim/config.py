"""The simulator's knobs (composed by ``EngineConfig``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.checks import check_choice, check_int, check_number
from ..model.config import ModelConfig, get_preset
from .hardware import get_gpu
from .precision import WEIGHT_DTYPES


@dataclass(frozen=True)
class SimConfig:
    """With a GPU name, every step is also timed by the cost model of
    ``sim_model`` on ``sim_gpu`` (``tensor_parallel_size`` x
    ``pipeline_parallel_size`` of them; see
    :class:`~minibatch_engine.config.EngineConfig`), its projection weights
    read in ``sim_weight_dtype`` (:mod:`.precision`)."""
    sim_gpu: str | None = None
    sim_model: str | ModelConfig | None = None
    step_overhead_s: float = 1e-3
    tensor_parallel_size: int = 1
    sim_weight_dtype: str = "auto"
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        check_choice("sim_weight_dtype", self.sim_weight_dtype, tuple(WEIGHT_DTYPES))
        check_number("step_overhead_s", self.step_overhead_s, 0.0, 1e3)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        if self.sim_gpu is not None:
            get_gpu(self.sim_gpu)
        if isinstance(self.sim_model, str):
            get_preset(self.sim_model)
        elif self.sim_model is not None and not isinstance(self.sim_model, ModelConfig):
            raise ValueError(f"sim_model must be a preset name or a ModelConfig, got {self.sim_model!r}")
