"""minibatch-engine: an LLM inference engine built chapter by chapter.

Front doors: ``LLM(model).generate(prompts, SamplingParams(...))`` and
``python -m minibatch_engine {generate,bench,simulate}``.
"""
from .config import EngineConfig, SpeculativeConfig
from .engine import Engine
from .llm import LLM, RequestOutput
from .model import ModelConfig, build_model, get_preset, load_model, reference_generate
from .request import Request, RequestStatus
from .sampling import SamplingParams
from .workload import make_workload

__all__ = ["LLM", "RequestOutput", "SamplingParams", "Engine", "EngineConfig", "SpeculativeConfig", "Request",
           "RequestStatus", "ModelConfig", "build_model", "get_preset", "load_model",
           "reference_generate", "make_workload"]
__version__ = "0.1.0"
