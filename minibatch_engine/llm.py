"""``LLM(model).generate(prompts, params)``: the offline front door, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tqdm.auto import tqdm

from .engine import Engine, EngineConfig
from .metrics import RequestMetrics, request_metrics
from .sampling import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: RequestMetrics
    samples: list[list[int]] | None = None     # n > 1: every sample's tokens, this one first


class LLM:
    """An engine around a model.

    ``model`` is ``"tiny"`` (the built-in seeded model), a path to a Hugging Face
    checkpoint directory, or a :class:`~minibatch_engine.model.Transformer`.
    Engine options (``scheduler``, ``max_num_seqs``, ``max_model_len``, ``sim_gpu``,
    ...) are passed as keyword arguments; see :class:`EngineConfig`.
    """

    def __init__(self, model="tiny", tokenizer=None, device: str = "auto", dtype: str = "float32",
                 seed: int = 0, **engine_options):
        from .model import Transformer, build_model
        if isinstance(model, Transformer):
            self.model = model
        elif model == "tiny":
            self.model = build_model("tiny", device=device, dtype=dtype, seed=seed)
        else:
            from .model.loader import load_model
            self.model = load_model(model, device=device, dtype=dtype)
        if tokenizer is None:
            from .model.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(model if isinstance(model, str) else "tiny")
        self.tokenizer = tokenizer
        self.config = EngineConfig(**engine_options)
        self.engine: Engine | None = None

    def generate(self, prompts: Sequence, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, arrival_times: Sequence[float] | None = None) -> list[RequestOutput]:
        """Run every prompt (text, or a list of token ids) to completion.

        Returns one output per prompt, in the order given. Each call runs a fresh
        engine, whose trace stays available as ``llm.engine.trace``.
        """
        if isinstance(prompts, (str,)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        engine = self.engine = Engine(self.model, self.config, eos_token_id=self.tokenizer.eos_token_id)
        reqs = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
            at = None if arrival_times is None else arrival_times[i]
            reqs.append(engine.add_request(ids, params, request_id=str(i), arrival_time=at, prompt_text=text))
        with tqdm(total=len(reqs), desc="generate", disable=not use_tqdm, leave=False) as bar:
            engine.run(progress=bar.update)
        return [RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, list(r.output_token_ids),
                              self.tokenizer.decode(r.output_token_ids), r.finish_reason,
                              request_metrics(r, engine.trace),
                              [list(x.output_token_ids) for x in engine.samples_of(r.request_id)])
                for r in reqs]
