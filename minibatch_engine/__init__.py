"""minibatch-engine: an LLM inference engine built chapter by chapter.

Front doors: ``LLM(model).generate(prompts, SamplingParams(...))`` (offline),
``AsyncLLM(model).stream(prompt, params)`` (online, streaming) and
``python -m minibatch_engine {generate,bench,simulate,sweep,serve}`` (``serve``:
OpenAI's HTTP API, :mod:`minibatch_engine.entrypoints.server`).
"""
from .entrypoints.async_llm import AsyncLLM, StreamOutput
from .config import EngineConfig
from .core.engine import Engine
from .llm import LLM, CompletionOutput, RequestOutput
from .model import ModelConfig, build_model, get_preset, load_model, reference_generate
from .core.request import Request, RequestStatus
from .sampling.params import SamplingParams
from .speculative.config import SpeculativeConfig
from .sampling.structured_output import StructuredOutputsParams
from .harness.workload import make_workload

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "AsyncLLM", "StreamOutput", "SamplingParams", "Engine", "EngineConfig",
           "SpeculativeConfig", "StructuredOutputsParams", "Request",
           "RequestStatus", "ModelConfig", "build_model", "get_preset", "load_model",
           "reference_generate", "make_workload"]
__version__ = "0.1.0"
