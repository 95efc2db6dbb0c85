"""Prefill/decode disaggregation in the simulator (DistServe, Splitwise).

``P`` prefill replicas compute each prompt and its first token; the prompt's
KV cache then crosses a link (:mod:`.link`) to one of ``D`` decode replicas,
which admit the request with that KV in place (:class:`~.connector.KVReceivingScheduler`)
and decode the rest. Each pool has its own router. The two phases no longer
share a GPU: a long prefill never stalls a decode step, and each pool can be
sized for its phase; the price is the transfer, and GPUs one phase leaves idle
the other cannot use.

Timing: the first token leaves the prefill replica (TTFT ends there, as when
the prefill side streams it to the user); the transfer delays the second
token (it counts in TPOT). A proxy that streams every token from the decode
side would add the transfer to TTFT instead.
The decode replica takes the KV when the request arrives there: its blocks are
taken at admission, as a KV connector pulls a remote KV cache into blocks its
scheduler gives it. The prefill replica frees its blocks once the prompt's
KV has been copied out.
"""
from __future__ import annotations

from tqdm.auto import tqdm

from ..harness.metrics import DEFAULT_PERCENTILES, RequestTiming, parse_goodput, parse_percentiles
from ..sampling.params import SamplingParams
from ..harness.workload import make_workload
from .connector import KVReceivingEngine
from .link import LinkQueue, get_link
from .replicas import Cluster, Replica, sim_engines
from .router import make_router
from .summary import replica_summary, totals


def _decode_engines(n, sim_gpu, sim_model, max_batch, max_model_len, **engine_options):
    return [KVReceivingEngine(None, sim_gpu=sim_gpu, sim_model=sim_model, max_num_seqs=max_batch,
                              max_model_len=max_model_len, **engine_options) for _ in range(n)]


class Disaggregated:
    """The hand-over between the pools of a :class:`~.replicas.Cluster`: when a
    prefill replica finishes a request's prompt, its KV is sent over the link
    and the request goes on to the decode pool."""

    def __init__(self, link, num_gpus_per_replica: int, kv_bytes_per_token: int):
        self.links = LinkQueue(get_link(link), num_gpus_per_replica)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.specs: dict[str, tuple[list[int], int, float]] = {}     # id -> (prompt, max_tokens, arrival)
        self.first_token: dict[str, float] = {}
        self.transfer_s: dict[str, float] = {}
        self.cluster: Cluster | None = None

    def on_finish(self, replica: Replica, req) -> None:
        if replica.pool != "prefill":
            return
        rid = req.request_id
        prompt, max_tokens, _ = self.specs[rid]
        done = replica.engine.trace[req.token_steps[-1]].sim_end
        self.first_token[rid] = done
        if max_tokens == 1:
            return
        arrived = self.links.send(replica.index, done, len(prompt) * self.kv_bytes_per_token)
        self.transfer_s[rid] = arrived - done
        self.cluster.submit(prompt + req.output_token_ids, SamplingParams(max_tokens=max_tokens - 1, ignore_eos=True),
                            arrived, rid, pool="decode")

    def on_route(self, replica: Replica, request_id: str) -> None:
        if replica.pool == "decode":         # the chosen decode replica expects the KV
            replica.engine.scheduler.expect(request_id, len(self.specs[request_id][0]))

    def timings(self) -> list[RequestTiming]:
        """What the client saw of each request: the first token from the prefill
        replica, the others from the decode replica."""
        later: dict[str, list[float]] = {}
        for r in self.cluster.pools["decode"].replicas:
            trace = r.engine.trace
            for req in r.engine.requests.values():
                later[req.request_id] = [trace[k].sim_end for k in req.token_steps]
        return [RequestTiming(arrival, [self.first_token[rid], *later.get(rid, [])], len(prompt))
                for rid, (prompt, _, arrival) in self.specs.items() if rid in self.first_token]


def simulate_disaggregated(prefill_replicas: int = 1, decode_replicas: int = 1, link: str = "nvlink",
                           workload: str = "uniform", num_requests: int = 200, arrival_rate: float | None = 4.0,
                           burstiness: float = 1.0, seed: int = 0, router: str = "least-requests",
                           decode_router: str = "least-requests", sim_gpu: str = "H100-SXM",
                           sim_model: str = "llama-3-8b", max_batch: int = 256, max_model_len: int = 8192,
                           percentiles=DEFAULT_PERCENTILES, goodput=None, progress: bool = False,
                           specs=None, **engine_options) -> tuple[dict, Cluster]:
    """Run a seeded workload (or the given ``specs``) on ``prefill_replicas``
    prefill and ``decode_replicas`` decode engines joined by ``link``
    (:data:`~.link.LINKS`). Returns (summary, cluster): the keys of
    :func:`~.colocated.simulate_cluster`, computed on what the client saw, plus
    the transfers' mean and p99 seconds and the link's busy seconds."""
    ps, slo = parse_percentiles(percentiles), parse_goodput(goodput)
    prefill = sim_engines(prefill_replicas, sim_gpu, sim_model, max_batch, max_model_len, **engine_options)
    decode = _decode_engines(decode_replicas, sim_gpu, sim_model, max_batch, max_model_len, **engine_options)
    tp = prefill[0].config.tensor_parallel_size
    hand = Disaggregated(link, tp, prefill[0].cost_model.kv_bytes_per_token)
    cluster = Cluster({"prefill": (prefill, make_router(router)), "decode": (decode, make_router(decode_router))},
                      on_finish=hand.on_finish, on_route=hand.on_route)
    hand.cluster = cluster
    if specs is None:
        specs = make_workload(workload, num_requests, seed=seed, vocab_size=256, arrival_rate=arrival_rate,
                              burstiness=burstiness)
    for i, s in enumerate(specs):
        hand.specs[f"req-{i}"] = (s.prompt_token_ids, s.max_tokens, s.arrival_time)
        cluster.submit(s.prompt_token_ids, SamplingParams(max_tokens=1, ignore_eos=True), s.arrival_time,
                       f"req-{i}", pool="prefill")
    with tqdm(total=len(specs), desc="disaggregated", unit="req", disable=not progress, leave=False) as bar:
        while cluster.step():
            bar.n = len(hand.first_token)
    prefill_reqs = [r for rep in cluster.pools["prefill"].replicas for r in rep.engine.requests.values()]
    summary = {"mode": "disaggregated", "prefill_replicas": prefill_replicas, "decode_replicas": decode_replicas,
               "link": hand.links.link.name, "router": router, "decode_router": decode_router,
               "workload": workload, "num_requests": len(specs), "arrival_rate": arrival_rate,
               "burstiness": burstiness, "seed": seed, "sim_gpu": sim_gpu, "sim_model": sim_model,
               "tensor_parallel_size": tp, "clock": "sim"}
    cluster.timings = hand.timings()
    summary.update(totals(cluster.timings, cluster.replicas, prefill_reqs, ps, slo,
                          num_gpus=(prefill_replicas + decode_replicas) * prefill[0].cost_model.num_gpus))
    moved = sorted(hand.transfer_s.values())
    summary.update(kv_transfers=len(moved), kv_transfer_ms_mean=1e3 * sum(moved) / len(moved) if moved else 0.0,
                   kv_transfer_ms_p99=1e3 * moved[min(len(moved) - 1, int(0.99 * len(moved)))] if moved else 0.0,
                   link_busy_s=hand.links.busy_s)
    summary["per_replica"] = [replica_summary(r, ps, slo) for r in cluster.replicas]
    return summary, cluster
