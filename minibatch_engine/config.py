"""The engine's knobs, validated in one place.

Names follow vLLM where it has the same knob. The defaults are a serving
engine's: iteration-level scheduling, a paged KV cache with prefix caching,
chunked prefill under a token budget and up to 256 running sequences, bounded
by KV memory. Static batching and the reserved cache stay available by name
for the chapters that teach them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from .attention.registry import BACKENDS
from .model.config import ModelConfig, get_preset
from .scheduler.continuous import check_token_budget
from .scheduler.policy import POLICIES
from .scheduler.preemption import PREEMPTION_MODES, VICTIMS

SCHEDULER_NAMES = ("continuous", "static")
KV_CACHES = ("paged", "reserved")         # and "auto": paged, or reserved for static batching
SPEC_METHODS = ("ngram", "draft_model")
# The token budget when none is given: vLLM ships 2048 to 16384 depending on the
# device and the entry point; 2048 keeps one step short on a CPU.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# KV memory for a real model on the CPU when no budget is given (vLLM's CPU
# backend defaults to 4 GiB; this keeps a laptop comfortable).
DEFAULT_CPU_KV_BYTES = 512 * 2**20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SpeculativeConfig:
    """Speculative decoding (chapter 9): guess ``num_speculative_tokens`` (k) tokens
    per decoding request cheaply, verify them in the target's next forward.

    method: ``"ngram"`` (prompt lookup: the k tokens that followed the latest
        earlier occurrence of the request's last n tokens, n tried from
        ``prompt_lookup_max`` down to ``prompt_lookup_min``) or ``"draft_model"``
        (a small model with the same vocabulary runs k greedy steps).
    draft_model: for ``"draft_model"``: a Transformer, ``"tiny"`` or a checkpoint
        directory (loaded on the target's device and dtype).
    sim_acceptance_rate: simulator only (no model): each proposed token is
        accepted with this probability, in order, until the first rejection (a
        seeded Bernoulli: an assumption, since acceptance depends on the text).
    sim_draft_model: simulator only: the preset whose roofline prices the
        draft's k steps (``"draft_model"``; default ``"llama-3.2-1b"``).
    seed: seeds the simulator's acceptance draws.

    Greedy requests give the same tokens with and without speculation. A seeded
    sampled request does not: rejection sampling consumes its generator
    differently, so it keeps the output's distribution, not the draws.
    """
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    draft_model: object = None
    sim_acceptance_rate: float = 0.7
    sim_draft_model: str | ModelConfig | None = None
    seed: int = 0

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method={self.method!r} is not one of "
                             f"{', '.join(map(repr, SPEC_METHODS))}")
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1),
                          ("seed", 0)):
            v = getattr(self, name)
            if not _is_int(v) or v < low:
                raise ValueError(f"speculative {name} must be an integer >= {low}, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        a = self.sim_acceptance_rate
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"speculative sim_acceptance_rate must be a number in [0, 1], got {a!r}")
        if self.method != "draft_model" and self.draft_model is not None:
            raise ValueError("draft_model is only used with method='draft_model'")
        if isinstance(self.sim_draft_model, str):
            get_preset(self.sim_draft_model)
        elif self.sim_draft_model is not None and not isinstance(self.sim_draft_model, ModelConfig):
            raise ValueError(f"sim_draft_model must be a preset name or a ModelConfig, got {self.sim_draft_model!r}")


@dataclass
class EngineConfig:
    """Knobs of the engine.

    scheduler: ``"continuous"`` (iteration-level scheduling, chapter 3) or
        ``"static"`` (padded batches, chapter 2).
    max_num_seqs: most sequences in one step (static: the batch size B).
    max_model_len: longest prompt + output a request may have. Defaults to
        ``min(model max_position, 1024)``.
    kv_cache: ``"paged"`` (blocks of ``block_size`` tokens taken as a sequence
        grows, chapter 4) or ``"reserved"`` (``max_model_len`` reserved per
        request, chapters 2 and 3). ``"auto"`` (default): paged, or reserved for
        static batching (which runs on nothing else).
    kv_budget_bytes / num_kv_blocks: the KV memory. By default the pool holds
        ``max_num_seqs x max_model_len`` tokens, capped by memory: on the
        simulated GPU ``gpu_memory_utilization`` of its memory minus the weights,
        on CUDA that share of the free memory, on the CPU 512 MiB. A reserved
        cache fits ``budget // (max_model_len x bytes per token)`` rows.
    enable_prefix_caching: paged cache only: share the full blocks of a common
        prompt prefix. watermark: share of blocks admission keeps free.
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
        running request of strictly worse priority for a waiting one) or
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
    sim_gpu, sim_model: with a GPU name, every step is also timed by the roofline
        cost model of ``sim_model`` (a preset name, or the engine's own model).
    """
    scheduler: str = "continuous"
    max_num_seqs: int = 256
    max_model_len: int | None = None
    kv_cache: str = "auto"
    block_size: int = 16
    kv_budget_bytes: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    watermark: float = 0.01
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
    sim_gpu: str | None = None
    sim_model: str | ModelConfig | None = None
    step_overhead_s: float = 1e-3

    def __post_init__(self):
        def choice(name, options):
            v = getattr(self, name)
            if v not in options:
                raise ValueError(f"{name}={v!r} is not one of {', '.join(map(repr, options))}")

        def integer(name, low, optional=False):
            v = getattr(self, name)
            if optional and v is None:
                return
            if not _is_int(v) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}{' or None' if optional else ''}, "
                                 f"got {v!r}")

        def number(name, low, high, low_open=False, high_open=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < low or v > high or (low_open and v == low) or (high_open and v == high):
                lo, hi = "(" if low_open else "[", ")" if high_open else "]"
                raise ValueError(f"{name} must be a number in {lo}{low}, {high}{hi}, got {v!r}")

        choice("scheduler", SCHEDULER_NAMES)
        choice("kv_cache", KV_CACHES + ("auto",))
        kv = self.kv_layout
        choice("preemption_mode", PREEMPTION_MODES)
        choice("preemption_victim", VICTIMS)
        choice("attention_backend", BACKENDS)
        choice("policy", POLICIES)
        if self.priority_aging_s is not None:
            number("priority_aging_s", 0.0, 1e9, low_open=True)
            if self.policy != "priority":
                raise ValueError(f"priority_aging_s={self.priority_aging_s!r} needs policy='priority' "
                                 f"(policy is {self.policy!r})")
        if self.client_weights is not None:
            if self.policy != "fair":
                raise ValueError(f"client_weights needs policy='fair' (policy is {self.policy!r})")
            if not isinstance(self.client_weights, dict) or not all(
                    not isinstance(w, bool) and isinstance(w, (int, float)) and math.isfinite(w) and w > 0
                    for w in self.client_weights.values()):
                raise ValueError(f"client_weights must map client ids to numbers > 0, got {self.client_weights!r}")
        if self.policy != "fcfs":
            if self.scheduler != "continuous":
                raise ValueError(f"policy={self.policy!r} needs the continuous scheduler (static batching "
                                 "forms its batches in arrival order)")
            if self.preemption_victim != "latest":
                raise ValueError(f"preemption_victim={self.preemption_victim!r} applies to policy='fcfs'; "
                                 f"under policy={self.policy!r} the policy chooses the victim")
        integer("max_num_seqs", 1)
        integer("max_model_len", 2, optional=True)
        integer("block_size", 1)
        integer("kv_budget_bytes", 1, optional=True)
        integer("num_kv_blocks", 1, optional=True)
        integer("max_num_partial_prefills", 1)
        integer("swap_space_bytes", 0)
        number("gpu_memory_utilization", 0.0, 1.0, low_open=True)
        number("watermark", 0.0, 1.0, high_open=True)
        number("step_overhead_s", 0.0, 1e3)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "cuda_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_num_batched_tokens != "auto":
            integer("max_num_batched_tokens", 1, optional=True)
        if self.scheduler == "static":
            if kv != "reserved":
                raise ValueError("static batching runs on the reserved cache: pass kv_cache='reserved' "
                                 "(or leave kv_cache='auto')")
            if self.max_num_batched_tokens not in ("auto", None):
                raise ValueError("a token budget (max_num_batched_tokens) needs the continuous scheduler")
        if self.preemption_mode == "swap" and kv != "paged":
            raise ValueError("swap preemption needs the paged KV cache (kv_cache='paged')")
        if self.speculative is not None:
            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig or None, got {self.speculative!r} "
                                 "(build one: SpeculativeConfig(method='ngram', num_speculative_tokens=3))")
            if self.scheduler != "continuous":
                raise ValueError("speculative decoding needs the continuous scheduler (scheduler='continuous')")
        if self.sim_gpu is not None:
            from .sim import get_gpu
            get_gpu(self.sim_gpu)
        if isinstance(self.sim_model, str):
            get_preset(self.sim_model)
        elif self.sim_model is not None and not isinstance(self.sim_model, ModelConfig):
            raise ValueError(f"sim_model must be a preset name or a ModelConfig, got {self.sim_model!r}")

    @property
    def kv_layout(self) -> str:
        """The KV cache ``kv_cache`` names, with ``"auto"`` decided."""
        if self.kv_cache == "auto":
            return "reserved" if self.scheduler == "static" else "paged"
        return self.kv_cache

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
        return replace(self, max_model_len=max_model_len, max_num_batched_tokens=budget, kv_cache=self.kv_layout)
