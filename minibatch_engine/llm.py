"""``LLM(model).generate(prompts, params)``: the offline front door, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tqdm.auto import tqdm

from .config import EngineConfig
from .engine import Engine
from .inputs import as_prompt_list, check_arrival_time, encode_text
from .metrics import RequestMetrics, request_metrics
from .sampling import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None                           # None when the model has no tokenizer
    finish_reason: str
    metrics: RequestMetrics
    samples: list[list[int]] | None = None     # n > 1: every sample's tokens, this one first

    def __repr__(self) -> str:
        """One readable line (the timings stay in ``metrics``)."""
        shown = f"text={self.text!r}" if self.text is not None else f"token_ids={self.token_ids!r}"
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, {shown}, "
                f"finish_reason={self.finish_reason!r}, {len(self.token_ids)} tokens)")


class LLM:
    """An engine around a model, with vLLM's defaults (continuous scheduling,
    paged KV cache, chunked prefill, prefix caching).

    ``model`` is ``"tiny"`` (the built-in seeded model), a path to a Hugging Face
    checkpoint directory, or a :class:`~minibatch_engine.model.Transformer`.
    ``tokenizer`` defaults to the one that came with the model (the byte
    tokenizer for ``"tiny"``, ``tokenizer.json`` for a checkpoint); a model
    without one takes token-id prompts only, and its outputs' ``text`` is None.
    Engine options (``scheduler``, ``max_num_seqs``, ``kv_layout``, ``sim_gpu``,
    ...) are keyword arguments, checked here; see :class:`EngineConfig`.
    """

    def __init__(self, model="tiny", tokenizer=None, device: str = "auto", dtype: str = "float32",
                 seed: int = 0, **engine_options):
        from .model.registry import resolve_model, tokenizer_for
        self.config = EngineConfig().with_overrides(**engine_options)   # fails here, not at generate
        self.model = resolve_model(model, device=device, dtype=dtype, seed=seed)
        self.config.resolve(self.model.config)
        self.tokenizer = tokenizer if tokenizer is not None else tokenizer_for(getattr(self.model, "source", None))
        self.engine: Engine | None = None

    def _encode(self, prompt, i: int) -> tuple[list, str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompts[{i}] is text but this model has no tokenizer: pass token ids, "
                                 "or LLM(..., tokenizer=...)")
            return encode_text(self.tokenizer, prompt, f"prompts[{i}]"), prompt
        return prompt, None

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, arrival_times: Sequence[float] | None = None,
                 priority: Sequence[int] | None = None,
                 client_id: Sequence[str] | None = None) -> list[RequestOutput]:
        """Run every prompt (text, or a list of token ids) to completion.

        ``arrival_times`` (one per prompt, seconds >= 0 in the engine's clock:
        simulated seconds with ``sim_gpu``, else wall seconds since the call)
        defers requests. ``priority`` (one per prompt, lower runs first) matters
        for ``policy="priority"``, ``client_id`` (one per prompt: the tenant) for
        ``policy="fair"``. Returns one output per prompt, in the order given. Each call runs
        a fresh engine, whose trace stays available as ``llm.engine.trace``.
        """
        prompts = as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        elif not isinstance(sampling_params, Sequence) or isinstance(sampling_params, (str, dict)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        for name, values in (("sampling_params", sampling_params), ("arrival_times", arrival_times),
                             ("priority", priority), ("client_id", client_id)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(values)} {name}: give one per prompt")
        if arrival_times is not None:
            arrival_times = [check_arrival_time(t, f"arrival_times[{i}]") for i, t in enumerate(arrival_times)]
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        engine = self.engine = Engine(self.model, self.config, eos_token_id=eos)
        reqs = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            ids, text = self._encode(prompt, i)
            reqs.append(engine.add_request(
                ids, params, request_id=str(i), prompt_text=text,
                arrival_time=None if arrival_times is None else arrival_times[i],
                priority=0 if priority is None else priority[i],
                client_id=None if client_id is None else client_id[i]))
        with tqdm(total=len(reqs), desc="generate", unit="req", disable=not use_tqdm, leave=False) as bar:
            engine.run(progress=bar.update)
        decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: None)
        return [RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, list(r.output_token_ids),
                              decode(r.output_token_ids), str(r.finish_reason),
                              request_metrics(r, engine.trace),
                              [list(x.output_token_ids) for x in engine.samples_of(r.request_id)])
                for r in reqs]
