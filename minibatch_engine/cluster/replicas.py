"""A cluster in the simulator: engine replicas behind a router, on one clock.

Each replica is a whole engine (the real scheduler and a
:class:`~minibatch_engine.runner.sim_runner.SimRunner`) with its own
simulated clock: it advances by its own steps' modelled times. The cluster
keeps the global order of events across those clocks: it always carries out
the earliest event next, either a replica's next step (at that replica's
clock) or an arrival (at its time). An arrival is routed there and then, from
the replicas' states at that moment; a replica whose step is in flight shows
the state it will have when the step ends. So the router decides with what it
could know, and a replica never runs ahead of a request that should have
joined it.

Replicas come in *pools*: one pool for co-located serving, a prefill pool and
a decode pool for disaggregation (:mod:`.disagg`); each pool has its own router
and its own :class:`~.prefix_index.PrefixIndex`.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..core.engine import Engine
from ..core.request import Request
from ..sampling.params import SamplingParams
from .prefix_index import PrefixIndex, block_hashes
from .router import ReplicaState, RouterPolicy

PREFIX_SOURCES = ("router", "replica")


@dataclass
class Replica:
    """One engine in the cluster, and what the router has sent it."""
    index: int
    engine: Engine
    pool: str = "all"
    routed: int = 0
    finished: int = 0

    @property
    def outstanding(self) -> int:
        """Requests routed here and not finished (queued, running or not yet arrived)."""
        return self.routed - self.finished

    @property
    def clock(self) -> float:
        return self.engine.sim_now

    @property
    def kv_usage(self) -> float:
        """Share of its KV blocks held by requests."""
        kv = self.engine.kv_cache
        return kv.num_used_blocks / kv.num_blocks


@dataclass
class Pool:
    """Replicas that take the same kind of request, and the router among them."""
    name: str
    replicas: list[Replica]
    router: RouterPolicy
    index: PrefixIndex
    chosen: list[int] = field(default_factory=list)    # the local index of each routing decision


@dataclass(order=True)
class _Arrival:
    time: float
    order: int
    pool: str = field(compare=False)
    request_id: str = field(compare=False)
    prompt: list[int] = field(compare=False)
    params: SamplingParams = field(compare=False)


class Cluster:
    """Simulated engines in pools, each pool behind a router.

    ``pools``: pool name -> (engines, router policy). ``prefix_source``: what a
    router knows of the prefix caches: ``"router"``, its own record of what it
    sent where (:class:`~.prefix_index.PrefixIndex`, all an HTTP router has), or
    ``"replica"``, the caches themselves (exact, as routers fed by KV events).
    ``on_finish(replica, request)`` is called for each request a replica
    finishes, ``on_route(replica, request_id)`` when one is routed (before the
    replica gets it).
    """

    def __init__(self, pools: dict[str, tuple[Sequence[Engine], RouterPolicy]], prefix_source: str = "router",
                 on_finish: Callable[[Replica, Request], None] | None = None,
                 on_route: Callable[[Replica, str], None] | None = None):
        if prefix_source not in PREFIX_SOURCES:
            raise ValueError(f"prefix_source must be one of {PREFIX_SOURCES}, got {prefix_source!r}")
        if not pools or any(not engines for engines, _ in pools.values()):
            raise ValueError("a cluster needs at least one pool, each with at least one engine")
        self.prefix_source, self.on_finish, self.on_route = prefix_source, on_finish, on_route
        self.replicas: list[Replica] = []
        self.pools: dict[str, Pool] = {}
        for name, (engines, router) in pools.items():
            members = []
            for e in engines:
                if e.cost_model is None or e.model is not None:
                    raise ValueError("cluster replicas are simulated engines: Engine(None, sim_gpu=..., sim_model=...)")
                members.append(Replica(len(self.replicas), e, name))
                self.replicas.append(members[-1])
            self.pools[name] = Pool(name, members, router, PrefixIndex(len(members), engines[0].kv_cache.block_size))
        self._arrivals: list[_Arrival] = []
        self._order = itertools.count()
        self.placement: dict[tuple[str, str], int] = {}    # (pool, request id) -> replica index
        self.timings: list = []      # what the client saw of each request (set by the simulate functions)

    def submit(self, prompt: Sequence[int], params: SamplingParams, arrival_time: float, request_id: str,
               pool: str | None = None) -> None:
        """A request that reaches ``pool``'s router (default: the first pool) at ``arrival_time``."""
        pool = pool or next(iter(self.pools))
        if pool not in self.pools:
            raise ValueError(f"unknown pool {pool!r}; this cluster has {', '.join(self.pools)}")
        heapq.heappush(self._arrivals, _Arrival(float(arrival_time), next(self._order), pool, str(request_id),
                                                list(prompt), params))

    def states(self, pool: Pool, prompt: Sequence[int]) -> list[ReplicaState]:
        """Each replica of ``pool`` as its router sees it for ``prompt`` (local indices)."""
        if self.prefix_source == "replica":
            hits = [r.engine.kv_cache.find_cached_prefix(prompt).num_tokens for r in pool.replicas]
        else:
            hits = pool.index.match(prompt)
        return [ReplicaState(i, r.outstanding, r.kv_usage, h) for i, (r, h) in enumerate(zip(pool.replicas, hits))]

    def _route(self, a: _Arrival) -> None:
        pool = self.pools[a.pool]
        hashes = block_hashes(a.prompt, pool.index.block_size)
        i = pool.router.choose(self.states(pool, a.prompt))
        if not 0 <= i < len(pool.replicas):
            raise ValueError(f"router {pool.router!r} chose replica {i} of a pool of {len(pool.replicas)}")
        pool.index.record(i, a.prompt, hashes)
        pool.chosen.append(i)
        r = pool.replicas[i]
        if self.on_route is not None:
            self.on_route(r, a.request_id)
        r.engine.add_request(a.prompt, a.params, request_id=a.request_id, arrival_time=a.time)
        r.routed += 1
        self.placement[(a.pool, a.request_id)] = r.index

    def has_unfinished(self) -> bool:
        return bool(self._arrivals) or any(r.engine.has_unfinished() for r in self.replicas)

    def step(self) -> bool:
        """Carry out the earliest event: a replica's step, or an arrival (ties:
        the arrival first, so that a step at the same instant sees it). False
        when nothing is left."""
        busy = [r for r in self.replicas if r.engine.has_unfinished()]
        nxt = min(busy, key=lambda r: (r.clock, r.index)) if busy else None
        if self._arrivals and (nxt is None or self._arrivals[0].time <= nxt.clock):
            self._route(heapq.heappop(self._arrivals))
            return True
        if nxt is None:
            return False
        for req in nxt.engine.step():
            nxt.finished += 1
            if self.on_finish is not None:
                self.on_finish(nxt, req)
        return True

    def run(self, progress: Callable[[], None] | None = None) -> None:
        """Every event, in time order, until every request has finished."""
        while self.step():
            pass


def sim_engines(n: int, sim_gpu: str, sim_model: str, max_batch: int = 256, max_model_len: int | None = 8192,
                **engine_options) -> list[Engine]:
    """``n`` simulated engines of one configuration (:class:`~minibatch_engine.config.EngineConfig`
    fields in ``engine_options``; ``max_model_len`` 8192 by default, room for a
    long conversation)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of replicas must be an integer >= 1, got {n!r}")
    return [Engine(None, sim_gpu=sim_gpu, sim_model=sim_model, max_num_seqs=max_batch,
                   max_model_len=max_model_len, **engine_options)
            for _ in range(n)]
