"""The simulated GPU clock: named GPUs, the measured cost of each operator
(:func:`op_times`), a cost model of a step, and the schedule of pipeline
stages (:func:`pipeline_time`)."""
from .cost_model import CostModel
from .hardware import GPU, GPUS, get_gpu
from .operators import op_times
from .pipeline import PipelineTiming, pipeline_time
from .roofline import RooflineCostModel, StepCost

__all__ = ["GPU", "GPUS", "get_gpu", "op_times", "CostModel", "RooflineCostModel", "StepCost",
           "PipelineTiming", "pipeline_time"]
