"""The simulator's knobs (composed by ``EngineConfig``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.checks import check_choice, check_int, check_number
from ..model.config import ModelConfig, get_preset
from .hardware import get_gpu
from .moe import check_expert_parallel
from .precision import WEIGHT_DTYPES


@dataclass(frozen=True)
class SimConfig:
    """With a GPU name, every step is also timed by the cost model of
    ``sim_model`` on ``sim_gpu`` (``tensor_parallel_size`` x
    ``pipeline_parallel_size`` of them; see
    :class:`~minibatch_engine.config.EngineConfig`), its projection weights
    read in ``sim_weight_dtype`` (:mod:`.precision`); a mixture of experts with
    its experts split over ``expert_parallel_size`` GPUs, the busiest carrying
    ``expert_load_imbalance`` times the mean load (:mod:`.moe`)."""
    sim_gpu: str | None = None
    sim_model: str | ModelConfig | None = None
    step_overhead_s: float = 1e-3
    tensor_parallel_size: int = 1
    sim_weight_dtype: str = "auto"
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_load_imbalance: float = 1.0

    def __post_init__(self):
        check_choice("sim_weight_dtype", self.sim_weight_dtype, tuple(WEIGHT_DTYPES))
        check_number("step_overhead_s", self.step_overhead_s, 0.0, 1e3)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        check_int("expert_parallel_size", self.expert_parallel_size, 1)
        check_number("expert_load_imbalance", self.expert_load_imbalance, 1.0, math.inf)
        if self.sim_gpu is not None:
            get_gpu(self.sim_gpu)
        model = get_preset(self.sim_model) if isinstance(self.sim_model, str) else self.sim_model
        if model is not None and not isinstance(model, ModelConfig):
            raise ValueError(f"sim_model must be a preset name or a ModelConfig, got {self.sim_model!r}")
        if model is not None:
            check_expert_parallel(model, self.expert_parallel_size, self.tensor_parallel_size,
                                  self.expert_load_imbalance)
        elif self.expert_parallel_size > 1:
            raise ValueError("expert_parallel_size > 1 needs the simulator and a mixture-of-experts sim_model")
