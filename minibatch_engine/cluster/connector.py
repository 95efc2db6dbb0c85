"""A KV connector: how one engine takes over a request whose prompt another
engine has already computed (vLLM's ``KVConnector``, split the same way).

* Scheduler side, :class:`KVReceivingScheduler`: told that a request's first
  ``n`` tokens have K/V on their way (:meth:`~KVReceivingScheduler.expect`),
  it admits the request with blocks for all its tokens and ``n`` of them
  counted as computed, so only the rest is computed here (for a request
  handed over after prefill: one token, a decode). It moves no bytes.
* Worker side, two runner wrappers that move the bytes: :class:`KVSavingRunner`
  copies a request's prompt K/V out of the pool in the step that completes
  its prefill (before the scheduler frees the blocks); :class:`KVLoadingRunner`
  writes received K/V into the blocks the scheduler gave the request, before
  the step's forward reads them.

The simulator needs only the scheduler side (its runner holds no tensors); the
real hand-over (:mod:`.handover`) uses both.
"""
from __future__ import annotations

import torch

from ..core.engine import Engine
from ..scheduler.continuous import ContinuousScheduler


class KVReceivingScheduler(ContinuousScheduler):
    """The continuous scheduler, plus one rule: a request :meth:`expect`-ed with
    ``n`` tokens of received K/V is admitted with ``num_computed_tokens = n``.
    A request preempted later recomputes as any other (its received K/V is gone)."""

    received: dict[str, int]

    @classmethod
    def adopt(cls, sched: ContinuousScheduler) -> "KVReceivingScheduler":
        """The same scheduler (queues, cache, policy), with the rule added."""
        if type(sched) is not ContinuousScheduler:
            raise TypeError(f"a KV-receiving scheduler extends the continuous scheduler, got {type(sched).__name__}")
        new = cls.__new__(cls)
        new.__dict__.update(sched.__dict__)
        new.received = {}
        return new

    def expect(self, request_id: str, num_tokens: int) -> None:
        """Request ``request_id`` (added now or later) arrives with the K/V of its
        first ``num_tokens`` tokens."""
        if num_tokens < 1:
            raise ValueError(f"request {request_id}: received K/V covers {num_tokens} tokens; give >= 1")
        self.received[request_id] = num_tokens

    def _admit(self, req, token_budget, allow_partial):
        n_kv = self.received.get(req.request_id)
        if n_kv is None or req.num_computed_tokens:
            return super()._admit(req, token_budget, allow_partial)
        if n_kv >= req.num_tokens:
            raise ValueError(f"request {req.request_id}: received K/V for {n_kv} tokens, but it has "
                             f"{req.num_tokens}: at least its last token must be computed here")
        n = req.num_tokens - n_kv
        if n > token_budget:
            return 0, False
        headroom = self.kv_cache.watermark_blocks if self.running else 0
        if self.kv_cache.allocate(req.request_id, req.num_tokens, 0, headroom=headroom):
            del self.received[req.request_id]
            req.num_computed_tokens = n_kv
            return n, False
        return 0, True

    def forget_expected(self, request_id: str) -> None:
        """Drop an expectation (the request was aborted before it was admitted)."""
        self.received.pop(request_id, None)


class KVReceivingEngine(Engine):
    """An engine whose scheduler is a :class:`KVReceivingScheduler` (a decode
    replica). ``engine.scheduler.expect(request_id, n)`` before or after
    ``add_request``."""

    def _make_scheduler(self):
        return KVReceivingScheduler.adopt(super()._make_scheduler())


def token_slots(block_table, num_tokens: int, block_size: int) -> torch.Tensor:
    """The pool slots of a sequence's first ``num_tokens`` tokens under its
    ``block_table`` (its slot mapping, as the runner computes it for a step)."""
    pos = torch.arange(num_tokens)
    return torch.tensor(block_table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


class _RunnerWrapper:
    def __init__(self, runner):
        self.runner = runner
        pool = runner.kv_pool
        if getattr(pool, "quantized", False):
            raise ValueError(f"the KV connector moves a float cache; this engine stores it as "
                             f"kv_cache_dtype={pool.kv_cache_dtype!r} (bytes and scales): run the P/D "
                             "engines with kv_cache_dtype='auto'")
        self._flat = pool.kv.view(pool.num_layers, 2, -1, pool.num_kv_heads, pool.head_dim)
        self.block_size = pool.block_size

    def __getattr__(self, name):
        return getattr(self.runner, name)


class KVSavingRunner(_RunnerWrapper):
    """Wraps a model runner: after a step that completes a request's prompt,
    its prompt K/V (``[layers, 2, prompt tokens, kv heads, head dim]``) waits in
    :attr:`outbox` until taken (:meth:`take`)."""

    def __init__(self, runner):
        super().__init__(runner)
        self.outbox: dict[str, torch.Tensor] = {}

    def execute(self, sched):
        out = self.runner.execute(sched)
        for s in sched.scheduled:
            if s.start < s.num_prompt_tokens <= s.start + s.num_tokens:
                slots = token_slots(s.block_table, s.num_prompt_tokens, self.block_size).to(self._flat.device)
                self.outbox[s.request_id] = self._flat[:, :, slots].clone()
        return out

    def take(self, request_id: str) -> torch.Tensor:
        """The saved prompt K/V of ``request_id`` (removed from the outbox)."""
        return self.outbox.pop(request_id)


class KVLoadingRunner(_RunnerWrapper):
    """Wraps a model runner: K/V given to :meth:`put` is written into the
    request's blocks in the step that admits it, before the forward."""

    def __init__(self, runner):
        super().__init__(runner)
        self.inbox: dict[str, torch.Tensor] = {}

    def put(self, request_id: str, kv: torch.Tensor) -> None:
        """Received K/V of a request's first ``kv.shape[2]`` tokens."""
        if kv.shape[:2] != self._flat.shape[:2] or kv.shape[3:] != self._flat.shape[3:]:
            raise ValueError(f"request {request_id}: received K/V of shape {tuple(kv.shape)} does not fit this "
                             f"pool ([{self._flat.shape[0]}, 2, tokens, {self._flat.shape[3]}, {self._flat.shape[4]}])")
        self.inbox[request_id] = kv

    def execute(self, sched):
        for s in sched.scheduled:
            kv = self.inbox.pop(s.request_id, None)
            if kv is not None:
                if s.start != kv.shape[2]:
                    raise RuntimeError(f"request {s.request_id}: admitted at position {s.start}, but its "
                                       f"received K/V covers {kv.shape[2]} tokens")
                slots = token_slots(s.block_table, kv.shape[2], self.block_size).to(self._flat.device)
                self._flat[:, :, slots] = kv.to(self._flat.device, self._flat.dtype)
        return self.runner.execute(sched)
