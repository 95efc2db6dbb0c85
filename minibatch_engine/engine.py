"""The engine: one loop, swappable parts.

    add_request -> Scheduler.schedule() -> SchedulerOutput
                                 |
         KV cache manager <- Executor.execute()  (the real model, or nothing in simulation)
                                 |
                           Engine.update -> outputs, metrics, trace

Every batching strategy of the book is a scheduler behind this loop; the
engine itself only moves tokens between the parts and writes the trace.
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, replace

import torch

from .executor import Executor, SimExecutor, TorchExecutor
from .kv import PagedKVCache, SlotKVCache, SwapSpace
from .model.config import ModelConfig, get_preset
from .request import Request, RequestStatus
from .sampling import SamplingParams
from .scheduler import make_scheduler
from .scheduler.preemption import Preemptor
from .sim import RooflineCostModel, get_gpu
from .trace import LaneRecord, StepRecord, Trace


@dataclass
class EngineConfig:
    """Knobs of the engine (names follow vLLM where it has the same knob).

    scheduler: ``"static"`` (padded batches, chapter 2) or ``"continuous"``
        (iteration-level scheduling, chapter 3).
    max_num_seqs: most requests in one step (static: the batch size B).
    max_model_len: longest prompt + output a request may have; each KV slot
        reserves this many tokens. Defaults to ``min(model max_position, 1024)``.
    kv_cache: ``"slot"`` (``max_model_len`` reserved per request) or ``"paged"``
        (blocks of ``block_size`` tokens taken as a sequence grows, chapter 4).
    kv_budget_bytes / num_kv_blocks: the KV memory. A slot cache fits
        ``budget // (max_model_len x bytes per token)`` slots (at most
        ``max_num_seqs``); a paged cache that many bytes of blocks. By default
        both get ``max_num_seqs x max_model_len`` tokens.
    enable_prefix_caching: paged cache only: share the full blocks of a common
        prompt prefix. watermark: share of blocks admission keeps free.
    preemption_mode: when the paged cache runs dry, ``"recompute"`` the victim
        later or ``"swap"`` its blocks to ``swap_space_bytes`` of host memory
        (falling back to recompute when that is full); ``preemption_victim``:
        ``"latest"`` arrival (vLLM's choice) or ``"most_blocks"``.
    max_num_batched_tokens: the per-step token budget (None: unlimited).
        With ``enable_chunked_prefill`` prompts are split into chunks that fill
        what decode tokens leave; ``max_num_partial_prefills`` prompts may be
        part-way at once. Without it a prompt waits until it fits whole.
    sim_gpu, sim_model: with a GPU name, every step is also timed by the roofline
        cost model of ``sim_model`` (a preset name, or the engine's own model).
    """
    scheduler: str = "static"
    max_num_seqs: int = 8
    max_model_len: int | None = None
    kv_cache: str = "slot"
    block_size: int = 16
    kv_budget_bytes: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 0
    preemption_victim: str = "latest"
    sim_gpu: str | None = None
    sim_model: str | ModelConfig | None = None
    step_overhead_s: float = 1e-3

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache not in ("slot", "paged"):
            raise ValueError(f"unknown kv_cache {self.kv_cache!r}; choose 'slot' or 'paged'")
        if self.kv_cache == "paged" and self.scheduler == "static":
            raise ValueError("static batching runs on the slot cache (kv_cache='slot')")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes <= 0:
            raise ValueError(f"kv_budget_bytes must be positive, got {self.kv_budget_bytes}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and self.kv_cache != "paged":
            raise ValueError("swap preemption needs the paged KV cache (kv_cache='paged')")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


class Engine:
    """Runs requests through a scheduler and an executor, one step at a time.

    ``model=None`` runs the simulator alone (``config.sim_gpu`` and
    ``config.sim_model`` required): no weights, no tensors, only the schedule
    and the modelled clock.
    """

    def __init__(self, model=None, config: EngineConfig | None = None, eos_token_id: int | None = None,
                 **overrides):
        cfg = config or EngineConfig(**overrides)
        self.config, self.model = cfg, model
        if model is None and (cfg.sim_gpu is None or cfg.sim_model is None):
            raise ValueError("without a model, both sim_gpu and sim_model are needed")
        sim_cfg = cfg.sim_model if isinstance(cfg.sim_model, ModelConfig) else (
            get_preset(cfg.sim_model) if cfg.sim_model else (model.config if model is not None else None))
        self.model_config: ModelConfig = model.config if model is not None else sim_cfg
        self.max_model_len = cfg.max_model_len or min(self.model_config.max_position, 1024)
        if self.max_model_len > self.model_config.max_position:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position {self.model_config.max_position}")
        self.eos_token_id = eos_token_id if eos_token_id is not None else self.model_config.eos_token_id
        device = model.device if model is not None else torch.device("meta")
        dtype = model.dtype if model is not None else torch.bfloat16
        self.kv_cache = self._make_kv_cache(dtype, device)
        self.swap_space = None
        if cfg.preemption_mode == "swap":
            self.swap_space = SwapSpace(self.model_config, cfg.swap_space_bytes // self.kv_cache.pool.bytes_per_block,
                                        cfg.block_size, dtype, device.type)
        self.scheduler = make_scheduler(
            cfg.scheduler, self.kv_cache, cfg.max_num_seqs, self.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens, enable_chunked_prefill=cfg.enable_chunked_prefill,
            max_num_partial_prefills=cfg.max_num_partial_prefills,
            preemptor=Preemptor(self.kv_cache, cfg.preemption_mode, self.swap_space, cfg.preemption_victim))
        self.executor: Executor = TorchExecutor(model, self.kv_cache) if model is not None else SimExecutor()
        self.cost_model = (RooflineCostModel(get_gpu(cfg.sim_gpu), sim_cfg, step_overhead_s=cfg.step_overhead_s)
                           if cfg.sim_gpu else None)
        self.trace = Trace()
        self.requests: dict[str, Request] = {}
        self.pending: list[tuple[float, int, Request]] = []   # future arrivals (heap)
        self.sim_now = 0.0
        self._t0 = time.perf_counter()
        self._ids = itertools.count()

    def _make_kv_cache(self, dtype, device):
        cfg, mc = self.config, self.model_config
        per_token = mc.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size())
        budget = cfg.kv_budget_bytes
        if cfg.kv_cache == "slot":
            slots = cfg.max_num_seqs if budget is None else min(cfg.max_num_seqs, budget // (per_token * self.max_model_len))
            if slots < 1:
                raise ValueError(f"a KV budget of {budget} bytes holds no slot of {self.max_model_len} tokens")
            return SlotKVCache(mc, slots, self.max_model_len, dtype, device)
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
        elif budget is not None:
            blocks = budget // (per_token * cfg.block_size)
        else:
            blocks = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        if blocks < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {cfg.block_size} tokens")
        return PagedKVCache(mc, blocks, cfg.block_size, dtype, device,
                            enable_prefix_caching=cfg.enable_prefix_caching, watermark=cfg.watermark)

    # --- clocks ------------------------------------------------------------------
    def wall_now(self) -> float:
        return time.perf_counter() - self._t0

    def now(self) -> float:
        """The engine's clock, in which arrival times are given: simulated seconds
        with a cost model, else wall seconds since the engine started."""
        return self.sim_now if self.cost_model is not None else self.wall_now()

    # --- requests ----------------------------------------------------------------
    def add_request(self, prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    prompt_text: str | None = None) -> Request:
        """Queue a request. ``prompt`` is a list of token ids. ``arrival_time`` (in the
        engine's clock) defers it; by default it arrives now."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt must contain at least one token")
        bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        req = Request(rid, ids, params, prompt=prompt_text, eos_token_id=self.eos_token_id)
        if req.max_total_tokens > self.max_model_len:
            raise ValueError(
                f"request {rid}: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) = "
                f"{req.max_total_tokens} tokens exceeds max_model_len ({self.max_model_len})")
        if req.max_total_tokens > self.kv_cache.max_tokens_per_request():
            raise ValueError(
                f"request {rid}: prompt ({len(ids)}) + max_tokens ({params.max_tokens}) = "
                f"{req.max_total_tokens} tokens can never fit the KV cache, which holds "
                f"{self.kv_cache.max_tokens_per_request()} tokens in all")
        if params.n > 1 and self.config.kv_cache != "paged":
            raise ValueError("parallel sampling (n > 1) forks sequences and needs kv_cache='paged'")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        self.requests[rid] = req
        if arrival_time is not None and arrival_time > self.now():
            heapq.heappush(self.pending, (arrival_time, len(self.requests), req))
        else:
            self._arrive(req)
        return req

    def _arrive(self, req: Request, at: float | None = None) -> None:
        req.arrival_step = len(self.trace)
        req.arrival_time = {"wall": self.wall_now()}
        if self.cost_model is not None:
            req.arrival_time["sim"] = self.sim_now if at is None else at
        self.scheduler.add_request(req)

    def _release_arrivals(self) -> None:
        while self.pending and self.pending[0][0] <= self.now():
            at, _, req = heapq.heappop(self.pending)
            self._arrive(req, at)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its KV memory is given back by its scheduler."""
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        if req.is_finished:
            return
        self.pending = [p for p in self.pending if p[2] is not req]
        heapq.heapify(self.pending)
        self.scheduler.abort(req)
        req.finish(len(self.trace), "abort")
        self.scheduler.on_request_finished(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pending)

    # --- the loop ------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step; returns the requests that finished in it."""
        self._release_arrivals()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.pending:   # idle until the next arrival
                nxt = self.pending[0][0]
                if self.cost_model is not None:
                    self.sim_now = max(self.sim_now, nxt)
                else:
                    time.sleep(max(0.0, nxt - self.wall_now()))
            return []
        step = len(self.trace)
        wall_start = self.wall_now()
        sim_dt = (self.cost_model.step_time(sched.sequence_shapes(), swap_bytes=sched.swap_bytes)
                  if self.cost_model else None)

        lanes, prefill_tokens = [], 0
        for s in sched.scheduled:
            if s.request.first_scheduled_step is None:
                s.request.first_scheduled_step = step
            kind = "prefill" if s.is_prefill else "decode"
            prefill_tokens += s.num_tokens if s.is_prefill else 0
            lanes.append(LaneRecord(s.request.request_id, self._slot(s.request), kind, s.num_tokens,
                                    s.request.num_computed_tokens))
        for p in sched.padding:
            lanes.append(LaneRecord(p.owner.request_id, self._slot(p.owner), "pad", p.num_tokens,
                                    p.start_position))

        result = self.executor.execute(sched)

        finished = []
        for s in sched.scheduled:
            r = s.request
            prev = r.num_computed_tokens
            r.num_computed_tokens += s.num_tokens
            self.kv_cache.mark_computed(r.request_id, r.all_token_ids, r.num_computed_tokens, prev)
            tok = result.sampled.get(r.request_id)
            if tok is not None and not r.is_finished:
                r.append_token(tok, step)
                if r.request_id in result.forks:
                    finished += self._fork(r, result.forks[r.request_id], step)
                if r.is_finished:
                    finished.append(r)
                    self.scheduler.on_request_finished(r)

        useful = sched.num_scheduled_tokens
        sim_start = self.sim_now if self.cost_model else None
        if self.cost_model:
            self.sim_now += sim_dt
        self.trace.append(StepRecord(
            step=step, lanes=lanes, batch_id=sched.batch_id,
            computed_tokens=useful + sched.num_padding_tokens, useful_tokens=useful,
            prefill_tokens=prefill_tokens, decode_tokens=useful - prefill_tokens,
            num_running=len(sched.scheduled), sampled_tokens=len(result.sampled),
            kv_reserved_bytes=self.kv_cache.reserved_bytes, kv_used_bytes=self.kv_cache.used_bytes,
            kv_capacity_bytes=self.kv_cache.capacity_bytes,
            wall_start=wall_start, wall_end=self.wall_now(),
            forward_s=result.forward_s, sample_s=result.sample_s,
            preempted=sched.preempted, swap_bytes=sched.swap_bytes,
            sim_start=sim_start, sim_end=self.sim_now if self.cost_model else None))
        return finished

    def _fork(self, parent: Request, samples, step: int) -> list[Request]:
        """Parallel sampling: the parent's prompt was prefilled once; each extra
        sample becomes a request sharing its KV blocks (copy-on-write)."""
        done = []
        for k, (token, generator) in enumerate(samples, start=1):
            p = parent.sampling_params
            child = Request(f"{parent.request_id}#{k}", parent.prompt_token_ids,
                            replace(p, n=1, seed=None if p.seed is None else p.seed + k),
                            prompt=parent.prompt, eos_token_id=parent.eos_token_id,
                            num_computed_tokens=parent.num_computed_tokens,
                            num_cached_tokens=parent.num_cached_tokens, parent_id=parent.request_id,
                            arrival_step=parent.arrival_step, arrival_time=dict(parent.arrival_time),
                            first_scheduled_step=parent.first_scheduled_step, generator=generator)
            self.requests[child.request_id] = child
            self.kv_cache.fork(parent.request_id, child.request_id)
            self.scheduler.add_running(child)
            child.append_token(token, step)
            if child.is_finished:
                done.append(child)
                self.scheduler.on_request_finished(child)
        return done

    def samples_of(self, request_id: str) -> list[Request]:
        """A request and, for n > 1, its forked samples, in order."""
        req = self.requests[request_id]
        return [req] + [self.requests[f"{request_id}#{k}"] for k in range(1, req.sampling_params.n)
                        if f"{request_id}#{k}" in self.requests]

    def _slot(self, req: Request) -> int:
        return self.kv_cache.block_table(req.request_id)[0] if self.kv_cache.holds(req.request_id) else -1

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
