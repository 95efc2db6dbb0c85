"""The engine's knobs: one flat keyword interface for users, composed of the
owners' configs (:class:`SchedulerConfig`, :class:`CacheConfig`,
:class:`RunnerConfig`, :class:`SimConfig`, :class:`SpeculativeConfig`), each
validated where it is used; ``EngineConfig`` itself checks only what crosses
owners (static batching needs the reserved cache, swap needs the paged one,
speculation needs the continuous scheduler).

Names follow vLLM where it has the same knob. The defaults are a serving
engine's: iteration-level scheduling, a paged KV cache with prefix caching,
chunked prefill under a token budget and up to 256 running sequences, bounded
by KV memory. Static batching and the reserved cache stay available by name
for the chapters that teach them.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .kv.config import CacheConfig
from .model.config import ModelConfig
from .runner.config import RunnerConfig
from .scheduler.config import SchedulerConfig, check_token_budget
from .sim.config import SimConfig
from .speculative.config import SpeculativeConfig

# The token budget when none is given: vLLM ships 2048 to 16384 depending on the
# device and the entry point; 2048 keeps one step short on a CPU.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# KV memory for a real model on the CPU when no budget is given (vLLM's CPU
# backend defaults to 4 GiB; this keeps a laptop comfortable).
DEFAULT_CPU_KV_BYTES = 512 * 2**20


@dataclass
class EngineConfig:
    """Knobs of the engine.

    scheduler: ``"continuous"`` (iteration-level scheduling, chapter 3) or
        ``"static"`` (padded batches, chapter 2).
    max_num_seqs: most sequences in one step (static: the batch size B).
    max_model_len: longest prompt + output a request may have. Defaults to
        ``min(model max_position, 1024)``.
    kv_layout: ``"paged"`` (blocks of ``block_size`` tokens taken as a sequence
        grows, chapter 4) or ``"reserved"`` (``max_model_len`` reserved per
        request, chapters 2 and 3). ``"auto"`` (default): paged, or reserved for
        static batching (which runs on nothing else).
    kv_budget_bytes / num_kv_blocks: the KV memory. By default the pool holds
        ``max_num_seqs x max_model_len`` tokens, capped by memory: on the
        simulated GPU ``gpu_memory_utilization`` of its memory minus the weights,
        on CUDA that share of the free memory, on the CPU 512 MiB. A reserved
        cache fits ``budget // (max_model_len x bytes per token)`` rows. With
        a draft model (speculative decoding) the budget covers the draft's
        cache too: it holds as many tokens as the target's, plus room per
        sequence for its guesses (``num_kv_blocks`` fixes the target's blocks;
        the draft's then come on top).
    enable_prefix_caching: paged cache only: share the full blocks of a common
        prompt prefix. watermark: share of blocks admission keeps free.
    kv_cache_dtype: how K and V are stored (vLLM's knob): ``"auto"`` (default,
        the model's dtype), ``"fp8"`` (float8 e4m3; ``"fp8_e4m3"`` is the same) or
        ``"int8"``: one byte per value plus a float32 scale per token and KV
        head (:mod:`minibatch_engine.kv.quant`), so a byte budget holds about
        twice the blocks of float16 (four times those of float32).
    max_num_batched_tokens: the per-step token budget. ``"auto"`` (default):
        2048 for the continuous scheduler (at least ``max_num_seqs``; at least
        ``max_model_len`` without chunked prefill), none for static batching.
        ``None``: no budget (Orca's scheduler, chapter 3).
    enable_chunked_prefill: prompts are split into chunks that fill what decode
        tokens leave; ``max_num_partial_prefills`` prompts may be part-way at once.
        Without it a prompt waits until it fits the budget whole.
    preemption_mode: when the paged cache runs dry, ``"recompute"`` the victim
        later or ``"swap"`` its blocks to ``swap_space_bytes`` of host memory
        (falling back to recompute when that is full); ``preemption_victim``:
        ``"latest"`` arrival (vLLM's choice) or ``"most_blocks"``.
    policy: who is admitted next and who is preempted (continuous scheduler,
        :mod:`~minibatch_engine.scheduler.policy`): ``"fcfs"`` (arrival order,
        the default), ``"priority"`` (lower ``priority`` first, preempting a
        running request of strictly worse priority for a waiting one; a
        request's ``priority`` is a 32-bit signed integer, see
        :func:`~minibatch_engine.core.request.check_priority`) or
        ``"fair"`` (the Virtual Token Counter between clients, ``client_id``, with
        optional ``client_weights``: client -> weight > 0).
    priority_aging_s: priority policy only: a request gains one priority level
        per ``priority_aging_s`` seconds in the system (engine clock), so none
        starves. ``None``: no aging.
    attention_backend: ``"auto"`` (Triton's paged kernel on CUDA when triton is
        installed; on a CPU the C++ paged kernel ``"cpp"`` when it builds, else
        ``"sdpa"``), ``"cpp"``, ``"sdpa"``, ``"triton"``, or ``"reference"`` (the
        readable ground truth every backend is tested against).
    speculative: a :class:`SpeculativeConfig` (continuous scheduler only), or
        None: no speculative decoding.
    cuda_graphs: replay a CUDA graph for decode-only steps (batch sizes bucketed,
        captured lazily; :mod:`minibatch_engine.runner.cuda_graphs`). Used only on
        CUDA with the ``"triton"`` backend; ignored elsewhere. Tokens are the same
        either way.
    cpu_threads: on a CPU, the threads of PyTorch's intra-op pool (which the C++
        kernels share): ``"auto"`` (default) takes the cores that are free when
        the engine starts, measured from ``/proc/stat``, so a busy machine does not
        leave threads spinning at barriers for cores another process holds
        (:mod:`minibatch_engine.runner.cpu_threads`); a number N takes N, or the
        free cores if fewer. It sets ``torch.set_num_threads`` for the whole process.
    cpu_threads_follow_load: re-decide the threads while the engine runs (default
        True): four times a second it reads ``/proc/stat`` and takes the cores other
        processes leave free, at most ``cpu_threads``, so load that arrives after
        the start does not leave threads spinning at barriers. False: the number
        given is kept as it is, whatever the load (to time kernels at a fixed count).
    sim_gpu, sim_model: with a GPU name, every step is also timed by the
        simulator's cost model of ``sim_model`` (a preset name, or the engine's
        own model): each operator as measured on real GPUs, in the order the
        kernels run (:mod:`minibatch_engine.sim.cost_model`).
    step_overhead_s: the simulated host's scheduling and input preparation per
        step (kernel launches are priced apart; ``cuda_graphs`` removes them
        from decode-only steps in the simulator too).
    tensor_parallel_size: simulator only: the model runs sharded over this many
        GPUs of ``sim_gpu`` (weights, KV heads and projections split; two
        all-reduces per layer); the KV memory is that of all of them.
    sim_weight_dtype: simulator only: the projection weights' dtype it prices,
        ``"auto"`` (bf16), ``"fp8"`` or ``"int4"`` (:mod:`minibatch_engine.sim.precision`):
        fewer bytes read per step and more memory left for KV. Priced by bytes
        alone; no fp8 or int4 GEMM was measured.
    pipeline_parallel_size: simulator only: the layers split into this many
        stages, each on ``tensor_parallel_size`` GPUs (8 to a node); a step's
        sequences go through them as micro-batches kept in flight (vLLM's
        virtual engines), activations handed over between stages at the
        measured send/recv speed (:mod:`minibatch_engine.sim.pipeline`); the KV
        memory is that of all the GPUs. Needs ``sim_gpu``; a real model still
        runs whole, so its tokens are the same.
    expert_parallel_size: simulator only, a mixture-of-experts ``sim_model``:
        its routed experts split over this many GPUs, attention data-parallel
        across them, a dispatch and a combine all-to-all per MoE layer
        (:mod:`minibatch_engine.sim.moe`); the KV memory is that of all of them.
    expert_load_imbalance: simulator only: the busiest expert-parallel GPU's
        routed tokens over the mean GPU's (1.0 = uniform routing).
    """
    scheduler: str = "continuous"
    max_num_seqs: int = 256
    max_model_len: int | None = None
    kv_layout: str = "auto"
    block_size: int = 16
    kv_budget_bytes: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int | None | str = "auto"
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1
    preemption_mode: str = "recompute"
    swap_space_bytes: int = 0
    preemption_victim: str = "latest"
    policy: str = "fcfs"
    priority_aging_s: float | None = None
    client_weights: dict | None = None
    attention_backend: str = "auto"
    speculative: SpeculativeConfig | None = None
    cuda_graphs: bool = True
    cpu_threads: int | str = "auto"
    cpu_threads_follow_load: bool = True
    sim_gpu: str | None = None
    sim_model: str | ModelConfig | None = None
    step_overhead_s: float = 1e-3
    tensor_parallel_size: int = 1
    sim_weight_dtype: str = "auto"
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_load_imbalance: float = 1.0

    def __post_init__(self):
        self.scheduler_config, self.cache_config, self.runner_config, self.sim_config   # each validates itself
        kv = self._decided_kv_layout()
        if self.scheduler == "static" and kv != "reserved":
            raise ValueError("static batching runs on the reserved cache: pass kv_layout='reserved' "
                             "(or leave kv_layout='auto')")
        if self.preemption_mode == "swap" and kv != "paged":
            raise ValueError("swap preemption needs the paged KV cache (kv_layout='paged')")
        if self.speculative is not None:
            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig or None, got {self.speculative!r} "
                                 "(build one: SpeculativeConfig(method='ngram', num_speculative_tokens=3))")
            if self.scheduler != "continuous":
                raise ValueError("speculative decoding needs the continuous scheduler (scheduler='continuous')")

    def _part(self, cls):
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's knobs (validated there)."""
        return self._part(SchedulerConfig)

    @property
    def cache_config(self) -> CacheConfig:
        """The KV cache's knobs (validated there)."""
        return self._part(CacheConfig)

    @property
    def runner_config(self) -> RunnerConfig:
        """The model runner's knobs (validated there)."""
        return self._part(RunnerConfig)

    @property
    def sim_config(self) -> SimConfig:
        """The simulator's knobs (validated there)."""
        return self._part(SimConfig)

    def _decided_kv_layout(self) -> str:
        """``kv_layout`` with ``"auto"`` decided."""
        if self.kv_layout == "auto":
            return "reserved" if self.scheduler == "static" else "paged"
        return self.kv_layout

    def with_overrides(self, **overrides) -> "EngineConfig":
        """A copy with some fields changed (validated again); unknown names are refused."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return replace(self, **overrides)

    def resolve(self, model_config: ModelConfig) -> "EngineConfig":
        """The same knobs with every ``None``/``"auto"`` default filled in for this
        model, and the checks that need the model's shape done."""
        max_model_len = self.max_model_len or min(model_config.max_position, 1024)
        if max_model_len > model_config.max_position:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position "
                             f"({model_config.max_position})")
        budget = self.max_num_batched_tokens
        if budget == "auto":
            if self.scheduler == "static":
                budget = None
            elif self.enable_chunked_prefill:
                budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
            else:
                budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
        if self.scheduler == "continuous":
            check_token_budget(budget, self.enable_chunked_prefill, self.max_num_seqs, max_model_len)
        return replace(self, max_model_len=max_model_len, max_num_batched_tokens=budget, kv_layout=self._decided_kv_layout())
