"""Scheduling policies: who is admitted next, and who gives memory back.

The continuous scheduler's token rule (``num_tokens - num_computed_tokens``,
capped by the budget) says *how much* a request computes. A policy says *who*:
the order in which waiting requests are admitted, and the victim when running
requests must give KV memory (or a place in the batch) back. Three policies:

* :class:`FCFSPolicy`, first come first served: admission in arrival order, a
  preempted request goes back to the head of the queue, the victim is the latest
  arrival (vLLM's choice; ``preemption_victim="most_blocks"`` picks the one
  holding the most blocks). Fair in arrival order, but a long request at the head
  blocks everyone behind it (head-of-line blocking).
* :class:`PriorityPolicy`: lower ``priority`` runs first, ties by arrival (vLLM's
  convention). When the best waiting request cannot be admitted, for want of KV
  blocks or of a place (``max_num_seqs``), the running request with the worst
  priority is preempted for it, if it is strictly worse. Optional *aging*: with
  ``aging_s`` the effective priority of a request at time ``now`` is

      effective(r) = r.priority - (now - r.arrival) / aging_s

  (a real number; lower is better): a request gains one priority level for every
  ``aging_s`` seconds it has been in the system (waiting or running), in the
  engine's clock (simulated seconds with the cost model, wall seconds
  otherwise). Because every request ages at the same rate, the order of two
  requests never flips back and forth: ``a`` is ahead of ``b`` exactly when
  ``a.priority * aging_s + a.arrival < b.priority * aging_s + b.arrival``, a
  fixed deadline. So a request of priority ``p`` is ahead of every request of
  priority ``q`` that arrives more than ``(p - q) * aging_s`` seconds after it:
  its wait is bounded, no one starves.
* :class:`FairSharePolicy`, the Virtual Token Counter (VTC) of Sheng et al.,
  "Fairness in Serving Large Language Models" (OSDI'24): one counter per client
  (``Request.client_id``) of the service it received, ``w_p`` per prompt token
  at admission and ``w_q`` per generated token (defaults 1 and 2), divided by
  the client's weight. Admission serves the client with the lowest counter
  (its earliest request first). When a client's queue goes from empty to
  non-empty, its counter is lifted to the minimum counter of the clients with
  queued work, so a client that was idle cannot bank credit and then
  monopolise the engine; when no client has queued work, to the counter of the
  client whose queue emptied last. The preemption victim is the latest request
  of the running client with the highest counter. The paper proves that two
  continuously backlogged clients receive service within ``2U`` of each other
  over any interval, with ``U = max(w_p * L_input, w_q * M)``, ``L_input`` the
  longest prompt and ``M`` the most tokens the running batch holds.

A policy sees :class:`~minibatch_engine.core.request.Request` objects only through
their ``priority``, ``client_id``, arrival and token counts; the scheduler calls
its hooks and keeps the queues.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from ..core.request import Request


class SchedulingPolicy:
    """Base class: arrival bookkeeping and the hooks the scheduler calls.

    ``key(r)`` orders requests (smaller runs first); ``select`` admits the
    smallest waiting key; ``choose_victim`` preempts the largest running key.
    """

    name = "base"
    requeue_at_head = False        # FCFS: a preempted request goes back to the queue's head
    orders_swapped = True          # a better waiting request goes before a swapped-out one

    def __init__(self):
        self.now: float | None = None
        self._seq: dict[str, int] = {}
        self._counter = itertools.count()

    # --- bookkeeping ------------------------------------------------------------
    def begin_step(self, now: float | None, running: Sequence[Request]) -> None:
        """Called at the start of every ``schedule``; ``now`` is the engine's clock."""
        self.now = now

    def on_arrival(self, req: Request, waiting: Sequence[Request]) -> None:
        """A new request joins the waiting queue (``waiting`` does not hold it yet)."""
        self._seq[req.request_id] = next(self._counter)

    def on_requeue(self, req: Request, waiting: Sequence[Request]) -> None:
        """A preempted request goes back to the waiting queue (not yet in ``waiting``)."""

    def on_admit(self, req: Request) -> None:
        """``req`` leaves the waiting queue and starts (or resumes) running."""

    def on_finish(self, req: Request, was_waiting: bool = False) -> None:
        """``req`` finished, or was ended from outside (``was_waiting``: while queued).
        Its arrival number stays: its forked samples may still be running."""

    def forget(self, req: Request) -> None:
        """``req`` (finished) is dropped for good: let go of what was kept about it."""
        self._seq.pop(req.request_id, None)

    def arrival_order(self, req: Request) -> int:
        """Arrival sequence number (a forked sample shares its parent's)."""
        if req.request_id in self._seq:
            return self._seq[req.request_id]
        return self._seq.get(req.parent_id, -1)

    # --- decisions --------------------------------------------------------------
    def key(self, req: Request):
        return (self.arrival_order(req),)

    def unorderable(self, requests: Sequence[Request]) -> dict[str, str]:
        """The requests whose :meth:`key` cannot be computed at this step
        (request id -> message): the scheduler ends them with an error, so one
        bad request cannot stop the step for the others. Every key is then
        known to work for the rest of the step (``now`` is fixed within it)."""
        bad = {}
        for r in requests:
            try:
                self.key(r)
            except Exception as e:
                bad[r.request_id] = f"scheduling failed ({self.name} policy): {type(e).__name__}: {e}"
        return bad

    def select(self, waiting: Sequence[Request]) -> Request:
        """The waiting request to admit next."""
        return min(waiting, key=self.key)

    def choose_victim(self, running: Sequence[Request], default: Callable[[Sequence[Request]], Request]) -> Request:
        """The running request that gives its memory back when one cannot grow.
        ``default`` is the preemptor's own rule (``preemption_victim``)."""
        return max(running, key=self.key)

    def victim_for(self, req: Request, running: Sequence[Request]) -> Request | None:
        """A running request to preempt so that waiting ``req`` can be admitted,
        or None (only the priority policy preempts for a waiting request)."""
        return None

    def beats(self, a: Request, b: Request) -> bool:
        """True when ``a`` should run before ``b``."""
        return self.key(a) < self.key(b)


class FCFSPolicy(SchedulingPolicy):
    """First come first served: the queue's order is arrival order; a preempted
    request returns to its head; the victim is the preemptor's choice."""

    name = "fcfs"
    requeue_at_head = True
    orders_swapped = False         # swapped-out requests come back first (vLLM)

    def unorderable(self, requests):
        return {}                   # arrival order: no arithmetic on the request

    def select(self, waiting):
        return waiting[0]

    def choose_victim(self, running, default):
        return default(running)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, ties by arrival; optional linear aging (see the
    module docstring for the exact rule)."""

    name = "priority"

    def __init__(self, aging_s: float | None = None):
        super().__init__()
        if aging_s is not None and not aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0 or None, got {aging_s!r}")
        self.aging_s = aging_s

    @staticmethod
    def arrival_time(req: Request) -> float:
        """Arrival in the engine's clock: simulated seconds when there are any."""
        t = req.arrival_time
        return t.get("sim", t.get("wall", 0.0))

    def effective_priority(self, req: Request, now: float | None = None) -> float:
        """``priority - (now - arrival) / aging_s``; the plain priority without aging."""
        now = self.now if now is None else now
        if self.aging_s is None or now is None:
            return req.priority
        return req.priority - (now - self.arrival_time(req)) / self.aging_s

    def key(self, req):
        return (self.effective_priority(req), self.arrival_order(req))

    def victim_for(self, req, running):
        if not running:
            return None
        worst = max(running, key=self.key)
        # Strictly worse priority only: equals are served in arrival order, never preempted.
        return worst if self.effective_priority(worst) > self.effective_priority(req) else None


class FairSharePolicy(SchedulingPolicy):
    """The Virtual Token Counter (Sheng et al., OSDI'24): serve the client that
    has received the least weighted service."""

    name = "fair"

    def __init__(self, w_p: float = 1.0, w_q: float = 2.0, weights: dict | None = None):
        super().__init__()
        if not (w_p > 0 and w_q > 0):
            raise ValueError(f"VTC weights must be > 0, got w_p={w_p!r}, w_q={w_q!r}")
        self.w_p, self.w_q = w_p, w_q
        self.weights = dict(weights or {})
        self.counters: dict = {}                 # client -> weighted service so far
        self.queued: dict = {}                   # client -> requests waiting
        self._charged_out: dict[str, int] = {}   # request id -> output tokens already counted
        self._charged_in: set[str] = set()       # requests whose prompt was counted
        self._last_emptied = None                # client whose queue emptied last

    def weight(self, client) -> float:
        return float(self.weights.get(client, 1.0))

    def counter(self, client) -> float:
        return self.counters.get(client, 0.0)

    def _charge(self, client, amount: float) -> None:
        self.counters[client] = self.counter(client) + amount / self.weight(client)

    def _join(self, req: Request) -> None:
        """``req`` enters the waiting queue: the lift rule when its client's
        queue was empty."""
        c = req.client_id
        if self.queued.get(c, 0) == 0:
            others = [self.counter(k) for k, n in self.queued.items() if n > 0 and k != c]
            if others:
                self.counters[c] = max(self.counter(c), min(others))
            elif self._last_emptied is not None and self._last_emptied != c:
                self.counters[c] = max(self.counter(c), self.counter(self._last_emptied))
        self.queued[c] = self.queued.get(c, 0) + 1
        self.counters.setdefault(c, 0.0)

    def on_arrival(self, req, waiting):
        super().on_arrival(req, waiting)
        self._join(req)

    def on_requeue(self, req, waiting):
        self._join(req)

    def _leave(self, client) -> None:
        self.queued[client] -= 1
        if self.queued[client] == 0:
            self._last_emptied = client

    def on_admit(self, req):
        c = req.client_id
        self._leave(c)
        if req.request_id not in self._charged_in:     # a prompt counts once, even if recomputed
            self._charged_in.add(req.request_id)
            self._charge(c, self.w_p * req.num_prompt_tokens)

    def forget(self, req):
        super().forget(req)
        self._charged_out.pop(req.request_id, None)
        self._charged_in.discard(req.request_id)

    def _charge_outputs(self, req: Request) -> None:
        new = req.num_output_tokens - self._charged_out.get(req.request_id, 0)
        if new > 0:
            self._charged_out[req.request_id] = req.num_output_tokens
            self._charge(req.client_id, self.w_q * new)

    def begin_step(self, now, running):
        super().begin_step(now, running)
        for r in running:                   # tokens generated in the previous step
            self._charge_outputs(r)

    def on_finish(self, req, was_waiting=False):
        if was_waiting:
            self._leave(req.client_id)
        self._charge_outputs(req)
        super().on_finish(req)
        self._charged_out.pop(req.request_id, None)
        self._charged_in.discard(req.request_id)

    def key(self, req):
        return (self.counter(req.client_id), self.arrival_order(req))

    def select(self, waiting):
        # The client with the lowest counter; its earliest request.
        return min(waiting, key=self.key)


POLICIES = ("fcfs", "priority", "fair")     # the names make_policy takes (EngineConfig.policy)


def make_policy(name: str, priority_aging_s: float | None = None,
                client_weights: dict | None = None) -> SchedulingPolicy:
    """The policy ``EngineConfig.policy`` names."""
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy(priority_aging_s)
    if name == "fair":
        return FairSharePolicy(weights=client_weights)
    raise ValueError(f"policy={name!r} is not one of {', '.join(map(repr, POLICIES))}")
