"""Many engines (chapter 12): router policies, the simulated cluster's event
order, prefix affinity, prefill/decode disaggregation and the KV hand-over."""
import json

import pytest
import torch

from minibatch_engine import Engine, SamplingParams, reference_generate
from minibatch_engine.harness.bench import run_bench
from minibatch_engine.entrypoints.cli import main
from minibatch_engine.cluster import (Cluster, LeastKV, LeastRequests, PrefixAffinity, PrefixIndex, ReplicaState,
                                      RoundRobin, make_router, simulate_cluster)
from minibatch_engine.cluster.connector import KVLoadingRunner, KVReceivingEngine, KVSavingRunner
from minibatch_engine.cluster.disagg import simulate_disaggregated
from minibatch_engine.cluster.link import LINKS, LinkQueue, get_link
from minibatch_engine.cluster.replicas import sim_engines
from minibatch_engine.harness.metrics import timings_from_trace
from minibatch_engine.harness.workload import make_workload

SIM = dict(sim_gpu="H100-SXM", sim_model="llama-3-8b")


# --- router policies ------------------------------------------------------------
def states(outstanding, kv=None, prefix=None):
    n = len(outstanding)
    kv, prefix = kv or [0.0] * n, prefix or [0] * n
    return [ReplicaState(i, o, k, p) for i, (o, k, p) in enumerate(zip(outstanding, kv, prefix))]


def test_round_robin_takes_replicas_in_turn_whatever_their_state():
    rr = RoundRobin()
    assert [rr.choose(states([9, 0, 0])) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_requests_and_least_kv_pick_the_least_loaded_lowest_index_on_ties():
    assert LeastRequests().choose(states([3, 1, 1, 2])) == 1
    assert LeastKV().choose(states([0, 5, 5], kv=[0.9, 0.2, 0.2])) == 1
    assert LeastKV().choose(states([4, 2, 5], kv=[0.3, 0.3, 0.1])) == 2


def test_prefix_affinity_takes_the_longest_match_within_the_load_guard():
    s = states([2, 0, 5], prefix=[64, 0, 128])
    assert PrefixAffinity(max_imbalance=8).choose(s) == 2        # the longest match
    assert PrefixAffinity(max_imbalance=3).choose(s) == 0        # replica 2 is too busy: next best
    assert PrefixAffinity(max_imbalance=0).choose(s) == 1        # only the least busy qualifies
    assert PrefixAffinity(max_imbalance=None).choose(states([50, 0], prefix=[16, 0])) == 0
    assert PrefixAffinity().choose(states([3, 1, 2])) == 1       # no match anywhere: least busy


def test_make_router_and_bad_inputs():
    assert isinstance(make_router("prefix", max_imbalance=2), PrefixAffinity)
    with pytest.raises(ValueError, match="unknown router policy 'random'"):
        make_router("random")
    with pytest.raises(ValueError, match="max_imbalance"):
        PrefixAffinity(max_imbalance=-1)
    with pytest.raises(ValueError, match="no replica"):
        LeastRequests().choose([])


def test_prefix_index_matches_whole_blocks_it_recorded_and_forgets_the_oldest():
    idx = PrefixIndex(2, block_size=4, capacity_blocks=3)
    a = list(range(13))                          # 3 full blocks (the last token never counts)
    idx.record(1, a)
    assert idx.match(a) == [0, 12]
    assert idx.match(a[:8] + [99, 98, 97, 96, 95]) == [0, 8]
    idx.record(1, [50, 51, 52, 53, 54])          # one more block: the oldest of a's goes
    assert idx.match(a) == [0, 0]


# --- the simulated cluster ------------------------------------------------------
def test_one_replica_behind_a_router_is_the_lone_engine():
    """The cluster's event order changes nothing for one replica: same times."""
    row, eng = run_bench(workload="chat", num_requests=40, arrival_rate=30.0, simulate_only=True, progress=False,
                         max_model_len=8192, **SIM)
    s, cluster = simulate_cluster(1, "round-robin", "chat", 40, arrival_rate=30.0, **SIM)
    alone = timings_from_trace(eng.requests.values(), eng.trace, "sim")
    rep = cluster.replicas[0].engine
    ours = timings_from_trace(rep.requests.values(), rep.trace, "sim")
    assert [(t.arrival, list(t.token_times)) for t in ours] == [(t.arrival, list(t.token_times)) for t in alone]


def test_an_arrival_during_a_step_keeps_its_arrival_time():
    e = Engine(None, max_model_len=256, **SIM)
    e.add_request([1] * 64, SamplingParams(max_tokens=4, ignore_eos=True))
    e.step()
    assert e.sim_now > 0
    req = e.add_request([2] * 8, SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=e.sim_now / 2)
    assert req.arrival_time["sim"] == e.sim_now / 2


@pytest.fixture(scope="module")
def multi_turn_runs():
    return {p: simulate_cluster(4, p, "multi-turn", 160, arrival_rate=16.0, goodput={"ttft": 500, "tpot": 50},
                                **SIM) for p in ("round-robin", "least-requests", "least-kv", "prefix")}


def test_prefix_affinity_hits_the_cache_more_than_round_robin(multi_turn_runs):
    hit = {p: s["prefix_hit_rate"] for p, (s, _) in multi_turn_runs.items()}
    assert hit["prefix"] > 2 * hit["round-robin"] and hit["prefix"] > hit["round-robin"] + 0.1
    assert multi_turn_runs["prefix"][0]["prefill_tokens"] < multi_turn_runs["round-robin"][0]["prefill_tokens"]


def test_every_request_finishes_once_and_no_replica_keeps_a_block(multi_turn_runs):
    for s, cluster in multi_turn_runs.values():
        assert s["completed"] == 160 and sum(r["requests"] for r in s["per_replica"]) == 160
        assert sorted(cluster.placement) == sorted(("all", f"req-{i}") for i in range(160))
        for r in cluster.replicas:
            assert r.outstanding == 0 and r.engine.kv_cache.num_used_blocks == 0


def test_cluster_runs_are_deterministic(multi_turn_runs):
    s, cluster = simulate_cluster(4, "prefix", "multi-turn", 160, arrival_rate=16.0,
                                  goodput={"ttft": 500, "tpot": 50}, **SIM)
    ref, ref_cluster = multi_turn_runs["prefix"]
    assert json.dumps(s, default=str) == json.dumps(ref, default=str)
    assert cluster.pools["all"].chosen == ref_cluster.pools["all"].chosen


def test_the_router_reading_the_replicas_caches_finds_at_least_its_own_record():
    s, _ = simulate_cluster(3, "prefix", "system-prompts", 60, arrival_rate=20.0, prefix_source="replica", **SIM)
    assert s["completed"] == 60 and s["prefix_hit_rate"] > 0.5
    with pytest.raises(ValueError, match="prefix_source"):
        Cluster({"all": (sim_engines(1, **SIM), RoundRobin())}, prefix_source="guess")


def test_a_cluster_refuses_real_model_engines(tiny32):
    with pytest.raises(ValueError, match="simulated engines"):
        Cluster({"all": ([Engine(tiny32)], RoundRobin())})


# --- workloads with shared prefixes -----------------------------------------------
def test_each_turn_extends_its_conversation_and_system_prompts_are_shared():
    w = make_workload("multi-turn", 80, seed=3, arrival_rate=8.0)
    assert w == make_workload("multi-turn", 80, seed=3, arrival_rate=8.0)
    assert [s.arrival_time for s in w] == sorted(s.arrival_time for s in w) and w[0].arrival_time >= 0
    last = {}
    for s in w:
        prev = last.get(s.client_id)
        if prev is not None:
            assert s.prompt_token_ids[:len(prev)] == prev and len(s.prompt_token_ids) > len(prev)
        last[s.client_id] = s.prompt_token_ids
    sp = make_workload("system-prompts", 50, seed=1)
    heads = {tuple(s.prompt_token_ids[:1024]) for s in sp}
    assert len(heads) <= 4 and len({s.request_class for s in sp}) == len(heads)


# --- links and disaggregation ----------------------------------------------------
def test_a_transfer_costs_latency_plus_bytes_over_bandwidth_and_queues_per_link():
    nv = get_link("nvlink")
    assert nv.bandwidth == 450e9 and LINKS["infiniband"].bandwidth == 50e9 and LINKS["pcie"].bandwidth == 64e9
    assert nv.transfer_seconds(450e6) == pytest.approx(nv.latency_s + 1e-3)
    assert nv.transfer_seconds(450e6, num_gpus=2) == pytest.approx(nv.latency_s + 0.5e-3)
    q = LinkQueue(LINKS["infiniband"])
    first = q.send(0, 1.0, 50e6)                  # 1 ms
    assert first == pytest.approx(1.0 + 1e-3 + 10e-6)
    assert q.send(0, 1.0, 50e6) == pytest.approx(first + 1e-3 + 10e-6)   # waits for the first
    assert q.send(1, 1.0, 50e6) == pytest.approx(first)                   # another GPU's link
    with pytest.raises(ValueError, match="unknown link"):
        get_link("carrier-pigeon")


@pytest.fixture(scope="module")
def disagg_run():
    return simulate_disaggregated(1, 2, "infiniband", "chat", 60, arrival_rate=12.0, **SIM)


def test_disaggregated_requests_get_every_token_and_leave_nothing_behind(disagg_run):
    s, cluster = disagg_run
    specs = make_workload("chat", 60, seed=0, vocab_size=256, arrival_rate=12.0)
    assert s["completed"] == 60
    decoded = {r.request_id: r for d in cluster.pools["decode"].replicas for r in d.engine.requests.values()}
    for i, spec in enumerate(specs):
        rid = f"req-{i}"
        if spec.max_tokens > 1:
            assert decoded[rid].num_output_tokens == spec.max_tokens - 1
            assert decoded[rid].num_prompt_tokens == len(spec.prompt_token_ids) + 1
    for r in cluster.replicas:
        assert r.engine.kv_cache.num_used_blocks == 0
    for d in cluster.pools["decode"].replicas:
        assert d.engine.scheduler.received == {}
        # the handed-over prompt is never computed again: one token at admission, then decodes
        assert sum(st.useful_tokens for st in d.engine.trace) == sum(
            r.num_output_tokens for r in d.engine.requests.values())


def test_the_transfer_is_priced_by_the_prompts_kv_bytes(disagg_run):
    s, cluster = disagg_run
    eng = cluster.replicas[0].engine
    per_token = eng.cost_model.kv_bytes_per_token
    assert per_token == 2 * 32 * 8 * 128 * 2            # Llama-3-8B in BF16: 128 KiB a token
    specs = make_workload("chat", 60, seed=0, vocab_size=256, arrival_rate=12.0)
    cheapest = min(LINKS["infiniband"].transfer_seconds(len(sp.prompt_token_ids) * per_token) for sp in specs)
    assert s["kv_transfers"] == sum(sp.max_tokens > 1 for sp in specs)
    assert s["kv_transfer_ms_mean"] >= cheapest * 1e3


def test_disaggregated_ttft_ends_at_the_prefill_replica(disagg_run):
    s, cluster = disagg_run
    prefill = cluster.pools["prefill"].replicas[0].engine
    t = timings_from_trace(prefill.requests.values(), prefill.trace, "sim")
    assert s["ttft_ms_mean"] == pytest.approx(1e3 * sum(x.ttft for x in t) / len(t))


# --- the KV hand-over, real tensors ------------------------------------------------
@pytest.mark.parametrize("block_size,chunk", [(4, None), (16, 8)])
def test_handed_over_kv_gives_the_lone_reference_tokens(tiny64, block_size, chunk):
    opts = dict(block_size=block_size, max_model_len=64)
    if chunk:
        opts.update(max_num_batched_tokens=chunk, max_num_seqs=4)
    prefill = Engine(tiny64, **opts)
    prefill.runner = KVSavingRunner(prefill.runner)
    decode = KVReceivingEngine(tiny64, **opts)
    decode.runner = KVLoadingRunner(decode.runner)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2, 3]]
    for i, p in enumerate(prompts):
        prefill.add_request(p, SamplingParams(max_tokens=1), request_id=f"r{i}")
    firsts = {r.request_id: r.output_token_ids[0] for r in prefill.run()}
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        decode.scheduler.expect(rid, len(p))
        decode.runner.put(rid, prefill.runner.take(rid))
        decode.add_request(p + [firsts[rid]], SamplingParams(max_tokens=7), request_id=rid)
    outs = {r.request_id: [firsts[r.request_id], *r.output_token_ids] for r in decode.run()}
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == reference_generate(tiny64, p, 8)
    assert sum(s.useful_tokens for s in decode.trace) == 2 * 7      # nothing recomputed
    for e in (prefill, decode):
        assert e.kv_cache.num_used_blocks == 0
    assert prefill.runner.outbox == {} and decode.runner.inbox == {} and decode.scheduler.received == {}


def test_received_kv_of_the_wrong_shape_is_refused(tiny64):
    decode = KVReceivingEngine(tiny64, max_model_len=64)
    decode.runner = KVLoadingRunner(decode.runner)
    with pytest.raises(ValueError, match="does not fit"):
        decode.runner.put("r", torch.zeros(1, 2, 5, 1, 1, dtype=torch.float64))


def test_two_processes_hand_over_kv_exactly_and_hold_nothing_after():
    from minibatch_engine.cluster.handover import run_handover
    from minibatch_engine.model.registry import resolve_model
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42], [7] * 33]
    out = run_handover(prompts, max_tokens=[6, 1, 4])
    ref = resolve_model("tiny", device="cpu", dtype="float32")
    assert [out.tokens[f"req-{i}"] for i in range(3)] == [reference_generate(ref, p, n)
                                                          for p, n in zip(prompts, [6, 1, 4])]
    assert all(v == 0 for side in out.leaks.values() for v in side.values())
    assert out.kv_bytes["req-0"] == 18 * ref.config.num_layers * 2 * ref.config.num_kv_heads * ref.config.head_dim * 4


# --- the command line ------------------------------------------------------------
def test_cli_simulates_a_cluster_and_writes_per_replica_json(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["simulate", "--replicas", "2", "--router", "prefix", "--workload", "system-prompts",
                 "--num-requests", "20", "--arrival-rate", "10", "--no-progress", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["replicas"] == 2 and len(s["per_replica"]) == 2 and s["router"] == "prefix"
    assert main(["simulate", "--prefill-replicas", "1", "--decode-replicas", "1", "--link", "pcie",
                 "--num-requests", "10", "--arrival-rate", "10", "--no-progress"]) == 0
    assert "over pcie" in capsys.readouterr().out
    assert main(["simulate", "--prefill-replicas", "1", "--no-progress"]) == 2
    assert main(["simulate", "--router", "prefix", "--no-progress"]) == 2
    assert "needs --replicas" in capsys.readouterr().err


def test_a_p_d_split_names_its_pools_and_must_take_every_gpu():
    """Chapter 12's designs: "disaggregated P:D" runs P prefill and D decode
    replicas (plain "disaggregated" is 1:1); co-located runs one replica per
    GPU; a split that leaves a pool empty or a GPU over is refused."""
    from minibatch_engine.book.cluster_report import pd_run, split_of
    assert split_of("disaggregated") == (1, 1) and split_of("disaggregated 3:1", 4) == (3, 1)
    for bad in ("disaggregated 0:4", "disaggregated 2:1"):
        with pytest.raises(ValueError, match="every GPU"):
            split_of(bad, 4)
    s, _ = pd_run("disaggregated 1:3", "chat", 8.0, 12, num_gpus=4)
    assert (s["prefill_replicas"], s["decode_replicas"]) == (1, 3) and s["num_requests"] == 12
    colo, _ = pd_run("co-located", "chat", 8.0, 12, num_gpus=4)
    assert len(colo["per_replica"]) == 4
