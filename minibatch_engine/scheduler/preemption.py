"""Preemption: taking KV memory back from a running request, losing nothing.

With blocks handed out on demand (chapter 4), running requests can grow until
no free block is left. The scheduler then preempts a victim and retries. The
scheduling policy (:mod:`.policy`) names the victim; under first come first
served it is this preemptor's own rule: the most recently arrived running
request (vLLM's choice) or the one holding the most blocks. Two ways to
take its memory:

* **recompute**: free the victim's blocks and put it back at the front of the
  queue. When it resumes, its prompt *and the tokens it already generated* are
  prefilled again (chunked like any prefill); its outputs are kept.
* **swap**: copy the victim's blocks to a bounded pool in host memory, free
  them on the GPU, and copy them back into free blocks when memory returns.
  When the host pool is full, fall back to recompute.

Either way the request's tokens are exactly those of a run with no preemption.
"""
from __future__ import annotations

from ..core.request import Request, RequestStatus
from ..core.outputs import Preemption, SwapIn

PREEMPTION_MODES = ("recompute", "swap")
VICTIMS = ("latest", "most_blocks")


class Preemptor:
    def __init__(self, kv_cache, mode: str = "recompute", swap_space=None, victim: str = "latest"):
        if mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {mode!r}")
        if victim not in VICTIMS:
            raise ValueError(f"victim policy must be one of {VICTIMS}, got {victim!r}")
        if mode == "swap" and swap_space is None:
            raise ValueError("swap preemption needs a swap space")
        self.kv_cache, self.mode, self.swap_space, self.victim = kv_cache, mode, swap_space, victim
        self.policy = None          # set by the scheduler: the policy that names victims

    def pick_victim(self, running: list[Request]) -> Request:
        """The running request that gives its memory back: the policy's choice
        (FCFS defers to ``victim``: "latest" or "most_blocks")."""
        if self.policy is not None:
            return self.policy.choose_victim(running, self._by_rule)
        return self._by_rule(running)

    def _by_rule(self, running: list[Request]) -> Request:
        if self.victim == "latest":
            return running[-1]
        return max(reversed(running), key=lambda r: len(self.kv_cache.block_table(r.request_id)))

    def preempt(self, victim: Request) -> Preemption:
        """Take the victim's KV memory; returns what was done (mode and bytes)."""
        victim.status = RequestStatus.PREEMPTED
        victim.spec_token_ids = []        # proposals are for the next step only
        victim.num_preemptions += 1
        if self.mode == "swap" and self.swap_space.can_swap_out(len(self.kv_cache.block_table(victim.request_id))):
            nbytes = self.kv_cache.swap_out(victim.request_id, self.swap_space)
            victim.num_swaps += 1
            return Preemption(victim.request_id, "swap", nbytes)
        self.kv_cache.free(victim.request_id)
        victim.num_recomputed_tokens += victim.num_computed_tokens
        victim.num_computed_tokens = 0
        return Preemption(victim.request_id, "recompute")

    def can_swap_in(self, req: Request, others_running: bool) -> bool:
        """Room for its blocks; while others run, also for its next token and the
        admission watermark (alone, it may take the whole pool, or it could never
        come back)."""
        headroom = 1 + self.kv_cache.watermark_blocks if others_running else 0
        return self.kv_cache.can_swap_in(self.swap_space, req.request_id, headroom)

    def swap_in(self, req: Request) -> SwapIn:
        nbytes = self.kv_cache.swap_in(req.request_id, self.swap_space, req.all_token_ids,
                                       req.num_computed_tokens)
        req.status = RequestStatus.RUNNING
        return SwapIn(req.request_id, nbytes)

    def discard(self, req: Request) -> None:
        """An aborted request gives its host blocks back too."""
        if self.swap_space is not None:
            self.swap_space.discard(req.request_id)
