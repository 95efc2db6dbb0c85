"""The simulated GPU clock: named GPUs and a roofline cost model of a step."""
from .cost_model import RooflineCostModel, StepCost
from .hardware import GPU, GPUS, get_gpu

__all__ = ["GPU", "GPUS", "get_gpu", "RooflineCostModel", "StepCost"]
