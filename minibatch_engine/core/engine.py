"""The engine: one loop, swappable parts.

    add_request -> Scheduler.schedule() -> SchedulerOutput
                                 |   (the KV cache manager, the scheduler's bookkeeping,
                                 |    decides blocks and block copies; plain data out)
                                 v
               Runner.execute()   (the KV pool and the real model, or SimRunner;
                                 |   after sampling, the proposer's guesses, chapter 9)
                                 v
              Scheduler.update_from_output() -> finished requests
                                 |
                    Engine: outputs, metrics, trace

Each part owns its state: the scheduler owns requests and their progress, and
(through its KV cache manager) the accounting of blocks; the runner owns
tensors (the KV pool, every byte moved in it), sampling state and speculative
decoding's proposer. The engine only releases arrivals on its clock, moves the
step's outputs between the parts, and records the trace.
"""
from __future__ import annotations

import heapq
import itertools
import time

import torch

from ..config import DEFAULT_CPU_KV_BYTES, EngineConfig
from .inputs import as_token_ids, check_arrival_time
from ..kv import HostKVPool, KVPool, PagedKVCache, ReservedKVCache, SwapSpace
from ..kv.quant import kv_bytes_per_token
from ..model.config import ModelConfig, get_preset
from .request import FinishReason, Request, check_priority
from .outputs import RunnerOutput, SchedulerOutput
from ..runner import ModelRunner, SimRunner
from ..sampling.params import SamplingParams
from ..scheduler import ContinuousScheduler, Scheduler, StaticScheduler
from ..scheduler.base import SAMPLE_ID
from ..scheduler.policy import make_policy
from ..scheduler.preemption import Preemptor
from ..sim import CostModel, get_gpu
from ..speculative import DraftModelProposer, NgramProposer, SimProposer
from ..sampling.structured_output import StructuredOutputManager
from .trace import LaneRecord, StepRecord, Trace


class Engine:
    """Runs requests through a scheduler and a model runner, one step at a time.

    ``Engine(model, config, **overrides)``: ``overrides`` change fields of
    ``config`` (or of the default :class:`EngineConfig`); unknown names are
    refused. ``model=None`` runs the simulator alone (``sim_gpu`` and
    ``sim_model`` required): no weights, no tensors, only the schedule and the
    modelled clock. ``tokenizer``: the vocabulary structured output compiles
    its grammars against (requests are token ids either way).
    """

    def __init__(self, model=None, config: EngineConfig | None = None, eos_token_id: int | None = None,
                 tokenizer=None, **overrides):
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__} "
                            "(pass options as keywords: Engine(model, max_num_seqs=8), or "
                            "Engine(model, EngineConfig(**options)))")
        cfg = (config or EngineConfig()).with_overrides(**overrides) if overrides else (config or EngineConfig())
        if model is None and (cfg.sim_gpu is None or cfg.sim_model is None):
            raise ValueError("without a model, both sim_gpu and sim_model are needed")
        sim_cfg = cfg.sim_model if isinstance(cfg.sim_model, ModelConfig) else (
            get_preset(cfg.sim_model) if cfg.sim_model else (model.config if model is not None else None))
        self.model = model
        self.model_config: ModelConfig = model.config if model is not None else sim_cfg
        self.config = cfg = cfg.resolve(self.model_config)
        self.max_model_len = cfg.max_model_len
        self.eos_token_id = eos_token_id if eos_token_id is not None else self.model_config.eos_token_id
        self.tokenizer = tokenizer
        if cfg.tensor_parallel_size > 1 and (model is not None or not cfg.sim_gpu):
            raise ValueError("tensor parallelism is simulated only: tensor_parallel_size > 1 needs the simulator "
                             "alone (no model, sim_gpu and sim_model)")
        if cfg.pipeline_parallel_size > 1 and not cfg.sim_gpu:
            raise ValueError("pipeline parallelism is simulated only: pipeline_parallel_size > 1 needs sim_gpu "
                             "(a real model still runs whole; the simulator prices the stages)")
        if (cfg.pipeline_parallel_size > 1 and cfg.speculative is not None
                and cfg.speculative.method == "draft_model"):
            raise ValueError("pipeline_parallel_size > 1 with a draft model is not simulated (where the draft "
                             "runs is a choice the simulator does not make); use pipeline_parallel_size 1")
        if cfg.expert_parallel_size > 1 and (model is not None or not cfg.sim_gpu):
            raise ValueError("expert parallelism is simulated only: expert_parallel_size > 1 needs the simulator "
                             "alone (no model, sim_gpu and a mixture-of-experts sim_model)")
        self.cost_model = (CostModel(get_gpu(cfg.sim_gpu), sim_cfg, tensor_parallel_size=cfg.tensor_parallel_size,
                                     pipeline_parallel_size=cfg.pipeline_parallel_size,
                                     step_overhead_s=cfg.step_overhead_s, cuda_graphs=cfg.cuda_graphs,
                                     expert_parallel_size=cfg.expert_parallel_size,
                                     expert_load_imbalance=cfg.expert_load_imbalance, **self._sim_dtypes())
                           if cfg.sim_gpu else None)
        device = model.device if model is not None else torch.device("meta")
        dtype = model.dtype if model is not None else torch.bfloat16
        spec = cfg.speculative
        draft = self._load_draft_model(model) if spec and spec.method == "draft_model" else None
        self.draft_cost_model = self._make_draft_cost_model(draft)
        self.kv_cache = self._make_kv_cache(dtype, device, draft)
        self.scheduler: Scheduler = self._make_scheduler()
        proposer = self._make_proposer(draft) if spec else None
        self.runner = (self._make_model_runner(model, proposer)
                       if model is not None else
                       SimRunner(acceptance_rate=spec.sim_acceptance_rate if spec else 0.0,
                                 seed=spec.seed if spec else 0, proposer=proposer))
        if model is not None:
            self.runner.eos_token_id = self.eos_token_id     # min_tokens holds it back
        self.trace = Trace()
        self.pending: list[tuple[float, int, Request]] = []   # future arrivals (heap)
        self.sim_now = 0.0
        self._t0 = time.perf_counter()
        self._ids = itertools.count()
        self._order = itertools.count()
        self._known_ids: set[str] = set()

    # --- construction -------------------------------------------------------------
    def _sim_dtypes(self) -> dict:
        """The bytes the simulator prices KV and weights in: the KV cache's dtype
        (``kv_cache_dtype``, when this engine has the knob) and ``sim_weight_dtype``."""
        return {"kv_cache_dtype": getattr(self.config, "kv_cache_dtype", "auto"),
                "weight_dtype": self.config.sim_weight_dtype}

    def _kv_budget(self, per_token: int, extra_bytes: int, device: torch.device) -> int:
        """Bytes of KV memory when the config names none: enough for every
        sequence at full length (and ``extra_bytes``), capped by the memory there is."""
        cfg = self.config
        want = cfg.max_num_seqs * cfg.max_model_len * per_token + extra_bytes
        if self.cost_model is not None and self.model is None:
            cap = self._sim_kv_memory()
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            cap = int(cfg.gpu_memory_utilization * free)
        else:
            cap = DEFAULT_CPU_KV_BYTES
        return min(want, max(cap, 0))

    def _sim_kv_memory(self) -> int:
        """The simulated GPUs' memory left for KV: ``gpu_memory_utilization`` of
        each, less its share of the weights (the target's, and a draft model's);
        refused when the weights alone do not fit."""
        cfg, cm = self.config, self.cost_model
        tp, gpu = cm.num_gpus, cm.gpu          # GPUs: tensor x pipeline x expert parallel
        weights = cm.resident_weight_bytes + (self.draft_cost_model.weight_bytes if self.draft_cost_model else 0)
        usable = cfg.gpu_memory_utilization * gpu.memory_bytes
        if cm.pp > 1:                    # no draft model here (refused above)
            if cm.weight_bytes_per_gpu > usable:
                need = -(-weights // int(usable))
                raise ValueError(f"{cm.model.name}'s weights take {weights / 1e9:.1f} GB, "
                                 f"{cm.weight_bytes_per_gpu / 1e9:.1f} GB on the fullest of {tp} "
                                 f"{gpu.name} (tensor_parallel_size {cm.tp} x pipeline_parallel_size {cm.pp}): "
                                 f"more than the {usable / 1e9:.1f} GB usable on each (gpu_memory_utilization "
                                 f"{cfg.gpu_memory_utilization}); {need} or more GPUs would fit them")
            return cm.kv_memory_bytes(usable)
        if weights / tp > usable:
            need = -(-weights // int(usable))
            knob = (f"tensor_parallel_size {need} or more would fit them" if cm.ep == 1 else
                    "expert parallelism copies attention and dense weights to every GPU: try tensor_parallel_size")
            raise ValueError(f"{cm.model.name}'s weights{' and the draft' if self.draft_cost_model else ''} take "
                             f"{weights / 1e9:.1f} GB, {weights / tp / 1e9:.1f} GB per GPU over "
                             f"{tp} {gpu.name}: more than the {usable / 1e9:.1f} GB usable on each "
                             f"(gpu_memory_utilization {cfg.gpu_memory_utilization}); {knob}")
        return int(tp * usable - weights)

    def _draft_block_size(self) -> int:
        cfg = self.config
        return cfg.block_size if cfg.kv_layout == "paged" else 16

    def _make_kv_cache(self, dtype, device, draft):
        """The target's KV cache manager. With a draft model the budget
        (``kv_budget_bytes``, or the memory there is) covers both caches: the
        draft holds as many tokens as the target, plus room per sequence for its
        k - 1 guesses and a partly filled block, and the target gets the rest."""
        cfg, mc = self.config, self.model_config
        per_token = kv_bytes_per_token(mc, dtype, cfg.kv_cache_dtype)
        if self.cost_model is not None and self.model is None:      # KV heads replicated past tp = KV heads
            per_token = int(per_token * self.cost_model.kv_replication)
        self.draft_tokens_per_seq = 0
        draft_per_token = 0
        if cfg.speculative is not None and cfg.speculative.method == "draft_model":
            # the real draft's shape, or (simulator alone) the shape its cost model prices
            draft_cfg = draft.config if draft is not None else self.draft_cost_model.model
            draft_per_token = kv_bytes_per_token(draft_cfg, dtype, cfg.kv_cache_dtype)
            if self.draft_cost_model is not None and self.model is None:
                draft_per_token = int(draft_per_token * self.draft_cost_model.kv_replication)
            self.draft_tokens_per_seq = cfg.speculative.num_speculative_tokens + self._draft_block_size()
        extra = cfg.max_num_seqs * self.draft_tokens_per_seq * draft_per_token
        explicit = cfg.kv_budget_bytes is not None
        budget = cfg.kv_budget_bytes if explicit else self._kv_budget(per_token + draft_per_token, extra, device)
        # the target's share: its tokens and as many draft tokens, after the draft's extra room
        total, budget = budget, max(0, budget - extra) * per_token // (per_token + draft_per_token)
        self.kv_budget_bytes, self._draft_kv_share = total, total - budget if draft_per_token else 0
        share = (f" ({total} bytes less the draft model's share, {total - budget})" if draft_per_token else "")
        if cfg.kv_layout == "reserved":
            rows = min(cfg.max_num_seqs, budget // (per_token * cfg.max_model_len))
            if rows < 1:
                raise ValueError(f"a KV budget of {budget} bytes{share} holds no row of {cfg.max_model_len} "
                                 f"tokens ({per_token * cfg.max_model_len} bytes); raise kv_budget_bytes or "
                                 "lower max_model_len")
            return ReservedKVCache(mc, rows, cfg.max_model_len, dtype, cfg.kv_cache_dtype)
        blocks = cfg.num_kv_blocks if cfg.num_kv_blocks is not None else budget // (per_token * cfg.block_size)
        if blocks < 1:
            raise ValueError(f"a KV budget of {budget} bytes{share} holds no block of {cfg.block_size} tokens; "
                             "raise kv_budget_bytes or lower block_size")
        return PagedKVCache(mc, blocks, cfg.block_size, dtype,
                            enable_prefix_caching=cfg.enable_prefix_caching, watermark=cfg.watermark,
                            kv_cache_dtype=cfg.kv_cache_dtype)

    def kv_split(self) -> dict[str, int]:
        """How the KV memory budget is shared: the target's cache and the draft
        model's (speculative decoding; 0 without a draft), in bytes and blocks.
        The simulator has no draft cache: its share is the bytes set aside."""
        draft = getattr(getattr(self.runner, "proposer", None), "kv_cache", None)
        return {"kv_budget_bytes": self.kv_budget_bytes, "target_kv_bytes": self.kv_cache.capacity_bytes,
                "target_kv_blocks": self.kv_cache.num_blocks,
                "draft_kv_bytes": draft.capacity_bytes if draft is not None else self._draft_kv_share,
                "draft_kv_blocks": draft.num_blocks if draft is not None else 0}

    def _check_sampling(self, rid: str, ids: list[int], params: SamplingParams) -> list[int]:
        """What only the engine can check in sampling parameters (the vocabulary,
        the context length); returns the prompt cut to ``truncate_prompt_tokens``."""
        vocab = self.model_config.vocab_size
        bad = [t for t, _ in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"request {rid}: logit_bias names token ids outside the vocabulary "
                             f"[0, {vocab}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and self.model is None:
                raise ValueError(f"request {rid}: {name} needs a model's logits, and the simulator "
                                 "computes none (its tokens are placeholders)")
            if v is not None and v > vocab:
                raise ValueError(f"request {rid}: {name}={v} asks for more tokens than the vocabulary "
                                 f"holds ({vocab})")
        if params.bad_words and not params.bad_words_token_ids:
            raise ValueError(f"request {rid}: bad_words {list(params.bad_words)!r} need a tokenizer: "
                             "pass them through LLM or AsyncLLM, or set bad_words_token_ids")
        if any(t >= vocab for w in params.bad_words_token_ids for t in w):
            raise ValueError(f"request {rid}: bad_words_token_ids hold ids outside [0, {vocab})")
        if params.structured_outputs is not None:
            try:
                self.check_grammar(params)
            except ValueError as e:
                raise ValueError(f"request {rid}: {e}") from None
        k = params.truncate_prompt_tokens
        if k is not None:
            keep = self.max_model_len - params.max_tokens if k == -1 else k
            if keep < 1:
                raise ValueError(f"request {rid}: truncate_prompt_tokens=-1 leaves no room: max_tokens "
                                 f"({params.max_tokens}) fills max_model_len ({self.max_model_len})")
            ids = ids[-keep:]
        return ids

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` (kept in the cache for the
        request that follows); a ``ValueError`` naming the field when it cannot
        be enforced. The scheduler gets its manager on the first such request."""
        if self.model is None:
            raise ValueError("structured_outputs needs a model's logits, and the simulator computes none")
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer (the grammar is over its "
                             "vocabulary): pass tokenizer= to the Engine, or use LLM or AsyncLLM")
        if self.eos_token_id is None:
            raise ValueError("structured_outputs needs an EOS token to end the output, and this model has none")
        so = self.scheduler.structured_output
        if so is None:
            try:
                so = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_id)
            except ImportError as e:            # xgrammar is an optional dependency
                raise ValueError(str(e)) from None
            self.scheduler.structured_output = so
        so.compile(params.structured_outputs)

    def _make_model_runner(self, model, proposer) -> ModelRunner:
        """The runner, with the tensors the scheduler's bookkeeping stands for: the
        KV pool on the model's device and, for swap preemption, its host pool;
        and speculative decoding's proposer, which it runs after sampling."""
        cfg = self.config
        pool = KVPool.for_cache(self.kv_cache, model.config, model.dtype, model.device, cfg.kv_cache_dtype)
        swap = getattr(self.scheduler, "preemptor", None) and self.scheduler.preemptor.swap_space
        host = (HostKVPool(model.config, swap.num_blocks, cfg.block_size, model.dtype, model.device.type,
                           cfg.kv_cache_dtype) if swap else None)
        return ModelRunner(model, pool, host_pool=host, attention_backend=cfg.attention_backend,
                           cuda_graphs=cfg.cuda_graphs, cpu_threads=cfg.cpu_threads,
                           cpu_threads_follow_load=cfg.cpu_threads_follow_load,
                           max_num_seqs=cfg.max_num_seqs,
                           max_model_len=cfg.max_model_len, proposer=proposer)

    def _load_draft_model(self, model):
        """The draft model, on the target's device and dtype (None in the simulator)."""
        if model is None:
            return None
        from ..model.registry import resolve_model
        spec = self.config.speculative
        if spec.draft_model is None:
            raise ValueError("speculative method='draft_model' needs draft_model= (a Transformer, 'tiny' "
                             "or a checkpoint directory)")
        draft = resolve_model(spec.draft_model, device=model.device, dtype=model.dtype)
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from "
                             f"the target's ({model.config.vocab_size}): a draft must share the tokenizer")
        return draft

    def _make_draft_cost_model(self, draft):
        """The cost model that prices a draft model on the simulated GPU (the draft's
        own shape, or ``sim_draft_model``); None without a draft or a simulator."""
        spec, cfg = self.config.speculative, self.config
        if spec is None or spec.method != "draft_model" or self.cost_model is None:
            return None
        draft_cfg = spec.sim_draft_model or ("llama-3.2-1b" if draft is None else draft.config)
        draft_cfg = get_preset(draft_cfg) if isinstance(draft_cfg, str) else draft_cfg
        return CostModel(get_gpu(cfg.sim_gpu), draft_cfg, tensor_parallel_size=cfg.tensor_parallel_size,
                         step_overhead_s=0.0, cuda_graphs=cfg.cuda_graphs, **self._sim_dtypes())

    def _make_proposer(self, draft):
        """Speculative decoding's proposer, for the runner: the simulator's stand-in,
        n-gram lookup, or the draft model with a KV cache of its share of the budget."""
        spec, cfg = self.config.speculative, self.config
        if self.model is None:
            return SimProposer(spec.num_speculative_tokens, draft_model=spec.method == "draft_model")
        if spec.method == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        bs = self._draft_block_size()
        tokens = self.kv_cache.num_blocks * self.kv_cache.block_size + cfg.max_num_seqs * self.draft_tokens_per_seq
        # whole blocks, rounded down: the two caches stay inside the budget
        return DraftModelProposer(draft, spec.num_speculative_tokens, tokens // bs, bs, cfg.attention_backend,
                                  kv_cache_dtype=cfg.kv_cache_dtype)

    def _make_scheduler(self) -> Scheduler:
        cfg = self.config
        if cfg.scheduler == "static":
            return StaticScheduler(self.kv_cache, cfg.max_num_seqs, cfg.max_model_len)
        swap = None
        if cfg.preemption_mode == "swap":
            swap = SwapSpace(cfg.swap_space_bytes // self.kv_cache.bytes_per_block, self.kv_cache.bytes_per_block)
        return ContinuousScheduler(
            self.kv_cache, cfg.max_num_seqs, cfg.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens, enable_chunked_prefill=cfg.enable_chunked_prefill,
            max_num_partial_prefills=cfg.max_num_partial_prefills,
            preemptor=Preemptor(self.kv_cache, cfg.preemption_mode, swap, cfg.preemption_victim),
            policy=make_policy(cfg.policy, cfg.priority_aging_s, cfg.client_weights))

    # --- clocks ---------------------------------------------------------------------
    def wall_now(self) -> float:
        return time.perf_counter() - self._t0

    def now(self) -> float:
        """The engine's clock, in which arrival times are given: simulated seconds
        with a cost model, else wall seconds since the engine was created."""
        return self.sim_now if self.cost_model is not None else self.wall_now()

    # --- requests -------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, Request]:
        """Every request the engine knows: arrived (owned by the scheduler) or pending."""
        out = {r.request_id: r for _, _, r in self.pending}
        out.update(self.scheduler.requests)
        return out

    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    prompt_text: str | None = None, priority: int = 0,
                    client_id: str | None = None) -> Request:
        """Queue a request. ``prompt`` is a list of token ids. ``arrival_time`` (in
        the engine's clock, :meth:`now`) defers it; by default it arrives now. An
        arrival time already past is kept as the request's simulated arrival (a
        router hands a replica a request that came while its step ran).
        ``priority``, an integer from -2**31 to 2**31 - 1 (lower runs first;
        ``check_priority`` refuses others by name), matters for the priority policy."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__} "
                            "(build one: SamplingParams(max_tokens=..., temperature=...))")
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        ids = as_token_ids(prompt, f"request {rid}: prompt")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"request {rid}: prompt token ids out of range [0, {self.model_config.vocab_size}): "
                             f"{bad[:5]}")
        ids = self._check_sampling(rid, ids, params)
        if rid in self._known_ids:
            raise ValueError(f"request_id {rid!r} is already in use")
        if SAMPLE_ID.fullmatch(rid):
            raise ValueError(f"request_id {rid!r} is reserved: ids ending in '#' and a number name the "
                             "samples of n > 1 requests")
        priority = check_priority(priority, f"request {rid}: priority")
        if arrival_time is not None:
            arrival_time = check_arrival_time(arrival_time, f"request {rid}: arrival_time")
        req = Request(rid, ids, params, prompt=prompt_text, eos_token_id=self.eos_token_id,
                      priority=priority, client_id=None if client_id is None else str(client_id))
        limit = min(self.max_model_len, self.kv_cache.max_tokens_per_request())
        if req.max_total_tokens > limit:
            what = (f"exceeds max_model_len ({self.max_model_len})" if limit == self.max_model_len else
                    f"can never fit the KV cache, which holds {limit} tokens in all")
            raise ValueError(f"request {rid}: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) = "
                             f"{req.max_total_tokens} tokens {what}")
        if params.n > 1 and self.config.kv_layout != "paged":
            raise ValueError(f"request {rid}: parallel sampling (n > 1) forks sequences and needs "
                             "kv_layout='paged'")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"request {rid}: n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        if arrival_time is not None and arrival_time > self.now():
            heapq.heappush(self.pending, (arrival_time, next(self._order), req))
        else:       # arrived already: by now, or earlier (a router's clock behind this step's end)
            self._arrive(req, arrival_time)
        self._known_ids.add(rid)
        return req

    def _arrive(self, req: Request, at: float | None = None) -> None:
        req.arrival_time = {"wall": self.wall_now()}
        if self.cost_model is not None:
            req.arrival_time["sim"] = self.sim_now if at is None else at
        self.scheduler.add_request(req)

    def _release_arrivals(self) -> None:
        while self.pending and self.pending[0][0] <= self.now():
            at, _, req = heapq.heappop(self.pending)
            self._arrive(req, at)

    def forget(self, request_id: str) -> None:
        """Let go of a finished request (see :meth:`Scheduler.forget`): what a
        long-running server does once the output is delivered. The id may then
        be used again."""
        self.scheduler.forget(request_id)
        self._known_ids.discard(request_id)

    def abort(self, request_id: str) -> list[Request]:
        """End a request wherever it is (not yet arrived, waiting, running, swapped
        out); its memory, and that of its n > 1 samples, is given back at once."""
        for i, (_, _, req) in enumerate(self.pending):
            if req.request_id == request_id:       # not arrived yet: hand it over, then end it
                self.pending.pop(i)
                heapq.heapify(self.pending)
                self._arrive(req)
                break
        return self.scheduler.finish_requests([request_id], FinishReason.ABORT)

    def samples_of(self, request_id: str) -> list[Request]:
        """A request and, for n > 1, its forked samples, in order."""
        return self.scheduler.samples_of(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pending)

    # --- the loop -------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it. A failure
        that belongs to one request (its scheduling arithmetic, its sampling,
        its stop checks) ends that request alone with finish reason ``error``
        (the message in ``Request.error``); the others go on."""
        self._release_arrivals()
        started = self.wall_now(), self.sim_now
        sched = self.scheduler.schedule(now=self.now())
        failed = self.scheduler.take_failed()   # requests the scheduler could not place: ended alone
        scheduled = self.wall_now()
        if sched.is_empty:
            if sched.block_copies or sched.finished_request_ids:
                self.runner.execute(sched)      # e.g. a lone request swapped itself out; state to drop
            if not failed:
                self._wait_for_arrival()
            return failed
        result = self.runner.execute(sched)
        lanes = self._lanes(sched)      # before the update: a request finishing now still holds its blocks
        ran = self.wall_now()
        finished = self.scheduler.update_from_output(sched, result)
        self._record(sched, result, lanes, started, (scheduled - started[0], self.wall_now() - ran))
        return failed + finished

    def _wait_for_arrival(self) -> None:
        """Nothing to run: move the clock to the next arrival."""
        if not self.pending:
            return
        nxt = self.pending[0][0]
        if self.cost_model is not None:
            self.sim_now = max(self.sim_now, nxt)
        else:
            time.sleep(max(0.0, nxt - self.wall_now()))

    def _lanes(self, sched: SchedulerOutput) -> list[LaneRecord]:
        """The step's lanes for the trace, each at its request's first block
        (its row, for a reserved cache) as the step computed it."""
        first_block = self.kv_cache.first_block
        lanes = [LaneRecord(s.request_id, first_block(s.request_id),
                            "prefill" if s.is_prefill else "decode", s.num_tokens, s.start)
                 for s in sched.scheduled]
        return lanes + [LaneRecord(p.owner_id, first_block(p.owner_id), "pad", p.num_tokens,
                                   p.start) for p in sched.padding]

    def _record(self, sched: SchedulerOutput, result: RunnerOutput, lanes: list[LaneRecord],
                started: tuple[float, float], phases: tuple[float, float]) -> None:
        """Append the step to the trace (and advance the simulated clock);
        ``lanes``: from :meth:`_lanes`, taken before the scheduler's update;
        ``phases``: the wall seconds of the scheduler's decision and update."""
        useful, prefill, verified = 0, 0, []     # one pass: this runs every step
        for s in sched.scheduled:
            useful += s.num_tokens
            if s.spec_token_ids:
                verified.append(s)
            if s.is_prefill:
                prefill += s.num_tokens
        sim_start = sim_end = draft_sim_s = None
        if self.cost_model is not None:
            sim_start = started[1]
            draft_sim_s = self.draft_cost_model.draft_time(result.draft_shapes) if self.draft_cost_model else 0.0
            self.sim_now = sim_end = sim_start + draft_sim_s + self.cost_model.step_time(
                sched.sequence_shapes(), swap_bytes=sched.swap_bytes, logits_rows=sched.num_logits_rows)
        self.trace.append(StepRecord(
            step=sched.step, lanes=lanes, batch_id=sched.batch_id,
            computed_tokens=useful + sched.num_padding_tokens, useful_tokens=useful,
            prefill_tokens=prefill, decode_tokens=useful - prefill,
            num_scheduled=len(sched.scheduled), sampled_tokens=result.num_sampled_tokens,
            kv_reserved_bytes=self.kv_cache.reserved_bytes, kv_used_bytes=self.kv_cache.used_bytes,
            kv_capacity_bytes=self.kv_cache.capacity_bytes,
            wall_start=started[0], wall_end=self.wall_now(),
            schedule_s=phases[0], prepare_s=result.prepare_s, forward_s=result.forward_s,
            sample_s=result.sample_s, update_s=phases[1],
            preempted=list(sched.preempted), swap_bytes=sched.swap_bytes,
            sim_start=sim_start, sim_end=sim_end,
            spec_proposed=sum(s.num_spec_tokens for s in verified), num_verifications=len(verified),
            spec_accepted=sum(len(result.sampled_token_ids[s.request_id]) - 1 for s in verified
                              if s.request_id in result.sampled_token_ids),   # (not one that failed)
            draft_s=result.draft_s, draft_sim_s=draft_sim_s if sim_start is not None else None))

    def run(self, progress=None) -> list[Request]:
        """Step until every request has finished; returns them in completion order.
        ``progress`` is an optional callable given the number of newly finished requests."""
        done: list[Request] = []
        while self.has_unfinished():
            finished = self.step()
            done += finished
            if progress is not None and finished:
                progress(len(finished))
        return done
