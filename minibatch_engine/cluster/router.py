"""The router: a second scheduler, in front of many engine replicas.

Each engine schedules its own requests step by step; the router decides, once
per request and before any engine sees it, which replica gets it. It knows
each replica only through a few numbers (:class:`ReplicaState`): what a load
balancer can read from a replica's metrics (requests outstanding, KV cache in
use) and how much of the request's prompt it expects that replica to hold in
its prefix cache. A policy maps those states to one replica; the same policy
object can front simulated replicas (:mod:`.replicas`) or HTTP servers, where
the states come from each server's ``/metrics`` and the router's own
:class:`~.prefix_index.PrefixIndex`.

Policies (names as ``simulate --router`` takes them):

* ``round-robin``: replicas in turn, blind to load and content;
* ``least-requests``: the fewest requests outstanding (routed, not finished);
  vLLM's data-parallel load balancing and most HTTP balancers' "least
  connections";
* ``least-kv``: the lowest share of KV cache in use (llm-d's KV-cache
  utilisation scorer);
* ``prefix``: prefix affinity: the replica expected to hold the longest cached
  prefix of the prompt, among those not much busier than the least busy (the
  *load guard*, in requests outstanding); with no match anywhere, the least
  busy. SGLang's cache-aware router, llm-d's prefix-cache scorer and Dynamo's
  KV-aware router are versions of this rule.

Ties go to the lowest replica index, so routing is deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows of one replica when a request arrives.

    ``outstanding``: requests routed there and not yet finished (queued, running,
    or on their way); ``kv_usage``: share of its KV cache in use, in [0, 1];
    ``prefix_tokens``: tokens of this request's prompt expected in its prefix
    cache."""
    index: int
    outstanding: int = 0
    kv_usage: float = 0.0
    prefix_tokens: int = 0


class RouterPolicy:
    """Picks one replica for a request from the replicas' states."""
    name = "base"

    def choose(self, states: Sequence[ReplicaState]) -> int:
        """The index of the chosen replica (one of ``states``' ``index``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _check(states: Sequence[ReplicaState]) -> None:
    if not states:
        raise ValueError("no replica to route to: give at least one ReplicaState")


class RoundRobin(RouterPolicy):
    """Replicas in turn."""
    name = "round-robin"

    def __init__(self):
        self.turn = 0

    def choose(self, states):
        _check(states)
        s = states[self.turn % len(states)]
        self.turn += 1
        return s.index


class LeastRequests(RouterPolicy):
    """The fewest requests outstanding."""
    name = "least-requests"

    def choose(self, states):
        _check(states)
        return min(states, key=lambda s: (s.outstanding, s.index)).index


class LeastKV(RouterPolicy):
    """The lowest share of KV cache in use (then the fewest outstanding)."""
    name = "least-kv"

    def choose(self, states):
        _check(states)
        return min(states, key=lambda s: (s.kv_usage, s.outstanding, s.index)).index


class PrefixAffinity(RouterPolicy):
    """The longest expected prefix match, among replicas with at most
    ``max_imbalance`` more requests outstanding than the least busy one (the
    load guard; ``None``: no guard). Among equal matches, the least busy."""
    name = "prefix"

    def __init__(self, max_imbalance: int | None = 8):
        if max_imbalance is not None and (isinstance(max_imbalance, bool) or not isinstance(max_imbalance, int)
                                          or max_imbalance < 0):
            raise ValueError(f"max_imbalance must be an integer >= 0 (requests) or None, got {max_imbalance!r}")
        self.max_imbalance = max_imbalance

    def choose(self, states):
        _check(states)
        fewest = min(s.outstanding for s in states)
        ok = [s for s in states if self.max_imbalance is None or s.outstanding <= fewest + self.max_imbalance]
        return min(ok, key=lambda s: (-s.prefix_tokens, s.outstanding, s.index)).index

    def __repr__(self) -> str:
        return f"PrefixAffinity(max_imbalance={self.max_imbalance})"


ROUTER_POLICIES = {p.name: p for p in (RoundRobin, LeastRequests, LeastKV, PrefixAffinity)}


def make_router(policy: str | RouterPolicy, **options) -> RouterPolicy:
    """A fresh policy object by name (``ROUTER_POLICIES``), or ``policy`` itself;
    ``options`` go to its constructor (``max_imbalance`` for ``"prefix"``)."""
    if isinstance(policy, RouterPolicy):
        if options:
            raise ValueError(f"options {sorted(options)} given with a built policy {policy!r}")
        return policy
    cls = ROUTER_POLICIES.get(policy)
    if cls is None:
        raise ValueError(f"unknown router policy {policy!r}; known: {', '.join(ROUTER_POLICIES)}")
    return cls(**options)
