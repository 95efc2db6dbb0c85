"""``LLM(model).generate(prompts, params)``: the offline front door, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tqdm.auto import tqdm

from .config import EngineConfig
from .core.engine import Engine
from .core.inputs import as_prompt_list, check_arrival_time, encode_text
from .harness.metrics import RequestMetrics, request_metrics
from .core.request import check_priority
from .sampling.params import SamplingParams
from .sampling.logits_process import with_bad_words
from .sampling.logprobs import as_dicts
from .core.stop_strings import cut_at, min_tokens_text, tokens_within


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's ``CompletionOutput``).

    ``index`` is its place among the request's ``n`` samples; ``text`` is None
    when the model has no tokenizer; ``finish_reason`` is ``"stop"`` (EOS, a
    stop token or a stop string), ``"length"`` (``max_tokens``), ``"abort"`` or
    ``"error"``."""
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None            # SamplingParams.logprobs: one {token_id: Logprob} per token
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns for one prompt, shaped like vLLM's:
    ``outputs`` holds one :class:`CompletionOutput` per sample (``n`` of them),
    ``outputs[0]`` first. ``metrics`` are the first sample's latencies."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list | None = None     # SamplingParams.prompt_logprobs: None, then one dict per token

    def __repr__(self) -> str:
        """Readable: the prompt and each sample's text (or tokens), finish reason
        and length; the timings stay in ``metrics``."""
        samples = ", ".join(
            f"{o.index}: " + (repr(o.text) if o.text is not None else repr(o.token_ids))
            + f" ({o.finish_reason}, {len(o.token_ids)} tokens)" for o in self.outputs)
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"outputs=[{samples}], finished={self.finished})")


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
    ``quantization`` (vLLM's knob): ``"int8"`` or ``"int8_weight_only"``
    quantizes the model's projections through torchao
    (:mod:`minibatch_engine.model.quantization`); None keeps ``dtype``.
    """

    def __init__(self, model="tiny", tokenizer=None, device: str = "auto", dtype: str = "float32",
                 seed: int = 0, quantization: str | None = None, **engine_options):
        from .model.registry import resolve_model, tokenizer_for
        self.config = EngineConfig().with_overrides(**engine_options)   # fails here, not at generate
        self.model = resolve_model(model, device=device, dtype=dtype, seed=seed, quantization=quantization)
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
        defers requests. ``priority`` (one per prompt, an integer from -2**31 to
        2**31 - 1, lower runs first) matters for ``policy="priority"``, ``client_id`` (one per prompt: the tenant) for
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
        if priority is not None:        # all checked before any request starts
            priority = [check_priority(p, f"priority[{i}]") for i, p in enumerate(priority)]
        if arrival_times is not None:
            arrival_times = [check_arrival_time(t, f"arrival_times[{i}]") for i, t in enumerate(arrival_times)]
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        engine = self.engine = Engine(self.model, self.config, eos_token_id=eos, tokenizer=self.tokenizer)
        reqs = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            ids, text = self._encode(prompt, i)
            params = with_bad_words(params, self.tokenizer, f"sampling_params[{i}]")
            reqs.append(engine.add_request(
                ids, params, request_id=str(i), prompt_text=text,
                arrival_time=None if arrival_times is None else arrival_times[i],
                priority=0 if priority is None else priority[i],
                client_id=None if client_id is None else client_id[i]))
        with tqdm(total=len(reqs), desc="generate", unit="req", disable=not use_tqdm, leave=False) as bar:
            engine.run(progress=bar.update)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return [RequestOutput(r.request_id, r.prompt, r.prompt_token_ids,
                              [completion(k, x, decode) for k, x in enumerate(engine.samples_of(r.request_id))],
                              all(x.is_finished for x in engine.samples_of(r.request_id)),
                              request_metrics(r, engine.trace),
                              None if r.prompt_logprobs is None else as_dicts(r.prompt_logprobs, decode))
                for r in reqs]


def completion(index: int, req, decode) -> CompletionOutput:
    """A finished :class:`~minibatch_engine.core.request.Request` as a :class:`CompletionOutput`,
    cut at its first stop string (``SamplingParams.stop``), as vLLM cuts it."""
    ids, text = list(req.output_token_ids), None if decode is None else decode(req.output_token_ids)
    reason = None if req.finish_reason is None else str(req.finish_reason)
    if text is not None and req.sampling_params.stop:
        after = min_tokens_text(ids, decode, req.sampling_params)
        cut = cut_at(text, req.sampling_params, after)
        if cut is not None:
            ids, text, reason = ids[:tokens_within(ids, decode, req.sampling_params.stop, after)], text[:cut], "stop"
    lps = None if req.logprobs is None else as_dicts(req.logprobs[:len(ids)], decode)
    total = None if req.logprobs is None else sum(e[1][0] for e in req.logprobs[:len(ids)])
    return CompletionOutput(index, text, ids, reason, lps, total)
