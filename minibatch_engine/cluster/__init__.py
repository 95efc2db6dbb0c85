"""Many engines: a router in front of simulated replicas, prefill/decode
disaggregation with priced KV transfers, and a real two-process KV hand-over
(chapter 12)."""
from .colocated import simulate_cluster
from .prefix_index import PrefixIndex
from .replicas import Cluster, Replica
from .router import (ROUTER_POLICIES, LeastKV, LeastRequests, PrefixAffinity, ReplicaState, RoundRobin,
                     RouterPolicy, make_router)

__all__ = ["Cluster", "Replica", "PrefixIndex", "ReplicaState", "RouterPolicy", "RoundRobin", "LeastRequests",
           "LeastKV", "PrefixAffinity", "ROUTER_POLICIES", "make_router", "simulate_cluster"]
