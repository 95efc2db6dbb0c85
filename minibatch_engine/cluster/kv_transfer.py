"""The engine side of request-level P/D disaggregation: vLLM's ``kv_transfer_params``.

vLLM splits a disaggregated request into two HTTP requests that a proxy (or
vllm-router's ``--vllm-pd-disaggregation``) sends one after the other:

1. to the *prefill* replica (producer), with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}``. It computes the prompt,
   and when the request finishes its KV blocks are *not* freed: they stay
   pinned until the decode replica has read them, or until a timeout. The
   response carries ``kv_transfer_params`` naming them: ``do_remote_prefill``,
   ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
   ``remote_host``, ``remote_port``;
2. to the *decode* replica (consumer), the original request plus those
   parameters. It pulls the K/V, writes them into blocks its own scheduler
   gives the request, and decodes on without computing the prompt again.

As in vLLM, the decode replica loads the K/V of every prompt token but the
last, and computes that one itself: its logits give the first output token,
so the prefill replica's token is never needed (the proxy drops it). The
decode replica computes 1 prompt token instead of all of them.

This module holds the parts inside one engine, and moves no byte over a
network (the server's :mod:`~minibatch_engine.entrypoints.server.kv_transfer`
does that):

* :class:`PinningScheduler`: the continuous scheduler plus two rules, one per
  side. Consumer: a request :meth:`~.connector.KVReceivingScheduler.expect`-ed
  is admitted with its received tokens counted as computed (chapter 12's
  :class:`~.connector.KVReceivingScheduler`). Producer: a request
  :meth:`~PinningScheduler.pin_on_finish`-ed keeps its prompt's blocks when it
  finishes, under a pin of its own (a :meth:`fork` of its block table, so the
  reference counts and the prefix cache stay exact), until
  :meth:`~PinningScheduler.unpin`.
* :class:`CountingLoader`: the runner wrapper that writes received K/V into
  the blocks (:class:`~.connector.KVLoadingRunner`), and counts the prompt
  tokens the model really computed, the evidence that a decode replica
  skipped the prompt.
* :class:`PDConnector`: what :class:`~minibatch_engine.entrypoints.async_llm.AsyncLLM`
  calls between steps: :meth:`~PDConnector.on_add` before a request enters
  the engine, :meth:`~PDConnector.on_end` once it has left it,
  :meth:`~PDConnector.take` to read and unpin a pinned prompt's K/V, and
  :meth:`~PDConnector.expire` to unpin what nobody pulled in time.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import torch

from ..core.request import FinishReason
from .connector import KVLoadingRunner, KVReceivingScheduler, token_slots

ROLES = ("kv_producer", "kv_consumer", "kv_both")
PIN = "kv-pin:"             # a pin's id in the KV cache: PIN + the request's id


@dataclass
class PinnedKV:
    """A finished prompt's K/V, held for a decode replica: its blocks (under the
    KV-cache id ``PIN + request_id``), its tokens, and when it is dropped."""
    request_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    deadline: float             # time.monotonic() after which it is unpinned


class PinningScheduler(KVReceivingScheduler):
    """:class:`~.connector.KVReceivingScheduler` plus pinning (see the module doc)."""

    @classmethod
    def adopt(cls, sched) -> "PinningScheduler":
        new = super().adopt(sched)
        new.pin_timeout_s, new.to_pin, new.pinned = 30.0, set(), {}
        return new

    def pin_on_finish(self, request_id: str) -> None:
        """When ``request_id`` finishes (length or stop, not abort or error), keep its
        prompt's blocks pinned for ``pin_timeout_s`` seconds."""
        self.to_pin.add(request_id)

    def _release(self, request):
        rid = request.request_id
        if rid in self.to_pin:
            self.to_pin.discard(rid)
            if request.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) \
                    and request.num_computed_tokens >= request.num_prompt_tokens:
                key = PIN + rid
                self.kv_cache.fork(rid, key)                        # one more reference to each block
                self.kv_cache.truncate(key, request.num_prompt_tokens)   # the prompt's blocks only
                self.pinned[rid] = PinnedKV(rid, tuple(request.prompt_token_ids),
                                            tuple(self.kv_cache.block_table(key)),
                                            time.monotonic() + self.pin_timeout_s)
        super()._release(request)

    def unpin(self, request_id: str) -> PinnedKV | None:
        """Give a pin's blocks back (None if ``request_id`` holds no pin)."""
        pin = self.pinned.pop(request_id, None)
        if pin is not None:
            self.kv_cache.free(PIN + request_id)
        return pin

    def forget_expected(self, request_id: str) -> None:
        super().forget_expected(request_id)
        self.to_pin.discard(request_id)


class CountingLoader(KVLoadingRunner):
    """:class:`~.connector.KVLoadingRunner` that also counts what the model ran:
    ``tokens_computed`` in all, ``prompt_tokens_computed`` of them prompt tokens."""

    def __init__(self, runner):
        super().__init__(runner)
        self.tokens_computed = self.prompt_tokens_computed = 0

    def execute(self, sched):
        for s in sched.scheduled:
            self.tokens_computed += s.num_tokens
            self.prompt_tokens_computed += max(0, min(s.start + s.num_tokens, s.num_prompt_tokens) - s.start)
        return super().execute(sched)


@dataclass
class TransferStats:
    """Counters of one connector (served as JSON by ``GET /kv_transfer/stats``)."""
    sent: int = 0               # pins pulled by a decode replica
    sent_tokens: int = 0
    expired: int = 0            # pins dropped at their timeout
    loaded: int = 0             # requests admitted with pulled K/V
    loaded_tokens: int = 0


class PDConnector:
    """One engine's side of P/D disaggregation (module doc). ``role``: vLLM's
    ``kv_role`` (``kv_producer``: a prefill replica, ``kv_consumer``: a decode
    replica, ``kv_both``); ``engine_id`` names this engine in the parameters;
    a pin is dropped ``pin_timeout_s`` seconds after its request finished."""

    def __init__(self, role: str = "kv_both", engine_id: str | None = None, pin_timeout_s: float = 30.0):
        if role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}, got {role!r}")
        if not pin_timeout_s > 0:
            raise ValueError(f"pin_timeout_s must be > 0, got {pin_timeout_s!r}")
        self.role, self.pin_timeout_s = role, float(pin_timeout_s)
        self.engine_id = engine_id or uuid.uuid4().hex
        self.stats = TransferStats()
        self.engine = None

    @property
    def produces(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def attach(self, engine) -> None:
        """Give ``engine`` the pinning scheduler and the loading runner (once, before any request)."""
        if self.engine is not None:
            raise RuntimeError("this connector already serves an engine")
        if not hasattr(engine.kv_cache, "manager"):
            raise ValueError(f"P/D disaggregation needs the paged KV cache, not {type(engine.kv_cache).__name__}")
        engine.scheduler = PinningScheduler.adopt(engine.scheduler)
        engine.scheduler.pin_timeout_s = self.pin_timeout_s
        engine.runner = CountingLoader(engine.runner)       # refuses a quantized KV cache by name
        self.engine = engine

    def identity(self) -> dict:
        """What must match between the two replicas for K/V to be reusable."""
        e, pool = self.engine, self.engine.runner.kv_pool
        return {"model": e.model_config.name, "num_layers": pool.num_layers, "num_kv_heads": pool.num_kv_heads,
                "head_dim": pool.head_dim, "dtype": str(pool.dtype).removeprefix("torch."),
                "kv_cache_dtype": pool.kv_cache_dtype, "block_size": pool.block_size}

    # --- AsyncLLM's hooks (on its loop, between steps) -------------------------------
    def on_add(self, engine, request_id: str, transfer: dict) -> None:
        """Before ``request_id`` enters the engine: ``{"pin": True}`` (a prefill
        replica keeps its prompt's K/V) or ``{"load": kv}`` (a decode replica
        received the K/V of its prompt's first ``kv.shape[2]`` tokens)."""
        sched = engine.scheduler
        if transfer.get("pin"):
            if not self.produces:
                raise ValueError(f"kv_transfer_params: do_remote_decode needs kv_role kv_producer or "
                                 f"kv_both; this server is {self.role}")
            sched.pin_on_finish(request_id)
        kv = transfer.get("load")
        if kv is not None:
            if not self.consumes:
                raise ValueError(f"kv_transfer_params: do_remote_prefill needs kv_role kv_consumer or "
                                 f"kv_both; this server is {self.role}")
            if kv.shape[2]:
                engine.runner.put(request_id, kv)
                sched.expect(request_id, kv.shape[2])
                self.stats.loaded += 1
                self.stats.loaded_tokens += kv.shape[2]

    def on_end(self, engine, request_id: str) -> None:
        """``request_id`` has left the engine: drop what it may not have used (an
        expectation and K/V never admitted, a pin it never reached)."""
        engine.scheduler.forget_expected(request_id)
        engine.runner.inbox.pop(request_id, None)

    # --- the producer's side --------------------------------------------------------------
    def pinned(self, request_id: str) -> PinnedKV | None:
        """The pin of a finished request (None: it finished without one)."""
        return self.engine.scheduler.pinned.get(request_id)

    def take(self, request_id: str) -> tuple[PinnedKV, torch.Tensor]:
        """Read a pin's K/V (``[layers, 2, tokens, kv heads, head dim]``, on the
        CPU) and unpin it. KeyError if there is no such pin (pulled already, or expired)."""
        sched = self.engine.scheduler
        pin = sched.pinned.get(request_id)
        if pin is None:
            raise KeyError(request_id)
        flat = self.engine.runner._flat
        slots = token_slots(list(pin.block_ids), len(pin.token_ids), self.engine.runner.block_size)
        kv = flat[:, :, slots.to(flat.device)].to("cpu", copy=True)
        sched.unpin(request_id)
        self.stats.sent += 1
        self.stats.sent_tokens += len(pin.token_ids)
        return pin, kv

    def expire(self, now: float | None = None) -> list[str]:
        """Unpin every pin past its deadline; returns their request ids."""
        now = time.monotonic() if now is None else now
        sched = self.engine.scheduler
        gone = [rid for rid, p in sched.pinned.items() if p.deadline <= now]
        for rid in gone:
            sched.unpin(rid)
        self.stats.expired += len(gone)
        return gone

    def snapshot(self) -> dict:
        """The counters, the pins held now and what the model computed."""
        runner, sched = self.engine.runner, self.engine.scheduler
        return {"role": self.role, "engine_id": self.engine_id, "pins_held": len(sched.pinned),
                "pinned_blocks": sum(len(p.block_ids) for p in sched.pinned.values()),
                "blocks_in_use": self.engine.kv_cache.num_used_blocks,
                "tokens_computed": runner.tokens_computed, "prompt_tokens_computed": runner.prompt_tokens_computed,
                **vars(self.stats)}
