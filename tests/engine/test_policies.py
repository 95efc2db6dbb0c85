"""Scheduling policies (FCFS, priority with preemption and aging, VTC fair share):
exact tokens, the ordering each promises, VTC's bound, aging against
starvation, no leaked KV block."""
from functools import lru_cache

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from minibatch_engine import LLM, Engine, EngineConfig, SamplingParams, reference_generate
from minibatch_engine.core.request import Request, RequestStatus
from minibatch_engine.scheduler.policy import FairSharePolicy, PriorityPolicy

from ..conftest import SIM, assert_all_memory_back




def policy_engine(policy, **kw):
    cfg = dict(kv_layout="paged", block_size=4, watermark=0.0, max_model_len=128, policy=policy)
    cfg.update(kw)
    return Engine(None, EngineConfig(**cfg, **SIM))


def params(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


# --- the correctness rule ----------------------------------------------------------
@lru_cache(maxsize=None)
def reference(model, prompt: tuple, n: int) -> list[int]:
    return reference_generate(model, list(prompt), n)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_every_policy_keeps_exact_greedy_tokens_under_preemption(tiny64, policy, mode):
    torch.manual_seed(3)
    lengths = [(9, 12), (5, 14), (12, 8), (7, 13), (4, 10)]
    prompts = [torch.randint(0, 256, (p,)).tolist() for p, _ in lengths]
    engine = Engine(tiny64, EngineConfig(kv_layout="paged", block_size=4, num_kv_blocks=11, watermark=0.0,
                                         max_num_seqs=3, max_model_len=64, policy=policy, preemption_mode=mode,
                                         max_num_batched_tokens=16))
    if mode == "swap":
        engine = Engine(tiny64, engine.config.with_overrides(
            swap_space_bytes=6 * engine.kv_cache.bytes_per_block))
    reqs = [engine.add_request(p, params(g), priority=(i * 7) % 3, client_id="ab"[i % 2])
            for i, (p, (_, g)) in enumerate(zip(prompts, lengths))]
    engine.run()
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was meant to force preemption"
    for r, p, (_, g) in zip(reqs, prompts, lengths):
        assert r.output_token_ids == reference(tiny64, tuple(p), g)
    assert_all_memory_back(engine)


@settings(max_examples=15, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(4, 14), st.integers(4, 12), st.integers(0, 3)), min_size=3, max_size=6),
       blocks=st.integers(7, 10), seqs=st.integers(2, 4), swap_blocks=st.integers(0, 8),
       aging=st.sampled_from([None, 0.05]))
# a request swapped back in without a grant that step, then scheduled later (it must be re-admitted)
@example(reqs=[(4, 4, 1), (12, 5, 0), (13, 4, 0)], blocks=7, seqs=3, swap_blocks=1, aging=None)
def test_priority_with_swap_keeps_exact_tokens_on_random_workloads(tiny64, reqs, blocks, seqs, swap_blocks,
                                                                  aging):
    """Priority preemption with swap (and the recompute fallback when the swap space
    is full, or zero): whatever the mix, every request's greedy tokens equal a lone
    full recompute, and no block leaks. (7-10 blocks of 4 for up to 6 requests of up
    to 26 tokens: most draws preempt, by swap and by recompute.)"""
    cfg = EngineConfig(kv_layout="paged", block_size=4, num_kv_blocks=blocks, watermark=0.0, max_num_seqs=seqs,
                       max_model_len=32, policy="priority", priority_aging_s=aging, preemption_mode="swap",
                       max_num_batched_tokens=16)
    engine = Engine(tiny64, cfg)
    swap_bytes = swap_blocks * engine.kv_cache.bytes_per_block
    engine = Engine(tiny64, cfg.with_overrides(swap_space_bytes=swap_bytes))
    prompts = [[(7 * i + j) % 250 + 1 for j in range(p)] for i, (p, _, _) in enumerate(reqs)]
    rs = [engine.add_request(p, params(g), priority=pr) for p, (_, g, pr) in zip(prompts, reqs)]
    engine.run()
    for r, p, (_, g, _) in zip(rs, prompts, reqs):
        assert r.output_token_ids == reference(tiny64, tuple(p), g)
    assert_all_memory_back(engine)


def test_llm_generate_takes_priority_and_client_id(tiny64):
    llm = LLM(tiny64, policy="priority", max_num_seqs=1, kv_layout="paged", max_model_len=64)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    outs = llm.generate(prompts, params(4), use_tqdm=False, priority=[2, 1, 0], client_id=["x", "y", "z"])
    assert [o.outputs[0].token_ids for o in outs] == [reference_generate(tiny64, p, 4) for p in prompts]
    first = {o.request_id: llm.engine.scheduler.requests[o.request_id].first_scheduled_step for o in outs}
    assert first["2"] < first["1"] < first["0"]     # one place: the best priority goes first
    assert [llm.engine.scheduler.requests[str(i)].client_id for i in range(3)] == ["x", "y", "z"]
    with pytest.raises(ValueError, match="client_id"):
        llm.generate(prompts, params(2), use_tqdm=False, client_id=["x"])


def test_config_checks_policy_options():
    with pytest.raises(ValueError, match="policy='lottery'"):
        EngineConfig(policy="lottery")
    with pytest.raises(ValueError, match="needs policy='priority'"):
        EngineConfig(priority_aging_s=1.0)
    with pytest.raises(ValueError, match="priority_aging_s"):
        EngineConfig(policy="priority", priority_aging_s=0)
    with pytest.raises(ValueError, match="client_weights"):
        EngineConfig(policy="fair", client_weights={"a": -1})
    with pytest.raises(ValueError, match="chooses the victim"):
        EngineConfig(policy="priority", preemption_victim="most_blocks")
    with pytest.raises(ValueError, match="continuous scheduler"):
        EngineConfig(policy="fair", scheduler="static")


# --- priority ------------------------------------------------------------------------
def watch_priority(engine):
    """Check, at every admission and every preemption, what the priority policy
    promises; returns the list of (victim, beneficiary) preemptions seen."""
    sched, policy = engine.scheduler, engine.scheduler.policy
    seen = []
    admit, preempt = policy.on_admit, sched._preempt

    def on_admit(req):
        better = [w for w in sched.waiting if policy.effective_priority(w) < policy.effective_priority(req)]
        assert not better, f"{req.request_id} admitted while {better[0].request_id} waits with a better priority"
        admit(req)

    def _preempt(victim, beneficiary=None):
        if beneficiary is not None and beneficiary is not victim:
            assert policy.key(victim) > policy.key(beneficiary)
            if beneficiary in sched.waiting:     # made room for a waiting request: strictly worse priority
                assert policy.effective_priority(victim) > policy.effective_priority(beneficiary)
            seen.append((victim, beneficiary))
        return preempt(victim, beneficiary)

    policy.on_admit, sched._preempt = on_admit, _preempt
    return seen


@settings(max_examples=30, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40), st.integers(0, 3),
                               st.floats(0, 0.2)), min_size=2, max_size=14),
       # at least 25 blocks of 4: the largest request (60 + 40 tokens) always fits
       blocks=st.integers(25, 60), seqs=st.integers(1, 5), aging=st.sampled_from([None, 0.01, 0.1]))
def test_priority_admits_the_best_and_preempts_only_worse(reqs, blocks, seqs, aging):
    engine = policy_engine("priority", num_kv_blocks=blocks, max_num_seqs=seqs, priority_aging_s=aging,
                        max_num_batched_tokens=64)
    seen = watch_priority(engine)
    rs = [engine.add_request([1 + i] * p, params(g), priority=pr, arrival_time=t)
          for i, (p, g, pr, t) in enumerate(reqs)]
    engine.run()
    assert all(r.is_finished and r.num_output_tokens == g for r, (_, g, _, _) in zip(rs, reqs))
    for victim, beneficiary in seen:
        assert victim.request_id != beneficiary.request_id
    assert_all_memory_back(engine)


@pytest.mark.parametrize("num_kv_blocks,max_num_seqs,prompt,low_tokens,high_tokens", [
    (64, 1, 8, 50, 5),      # one place (max_num_seqs=1): a low-priority request runs; a high one arrives
    (8, 4, 16, 12, 12),     # memory: the pool holds one request; a place is free, blocks are not
], ids=["for-a-place", "for-memory"])
def test_priority_preempts_for_a_place_and_for_memory(num_kv_blocks, max_num_seqs, prompt, low_tokens,
                                                       high_tokens):
    engine = policy_engine("priority", num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs)
    seen = watch_priority(engine)
    low = engine.add_request([1] * prompt, params(low_tokens), priority=5)
    engine.step()
    high = engine.add_request([2] * prompt, params(high_tokens), priority=0)
    engine.run()
    assert [(v.request_id, b.request_id) for v, b in seen] == [(low.request_id, high.request_id)]
    assert high.finish_step < low.finish_step and low.num_output_tokens == low_tokens
    assert_all_memory_back(engine)
    # Under FCFS neither preempts: the high-priority request waits.
    engine = policy_engine("fcfs", num_kv_blocks=8, max_num_seqs=4)
    low = engine.add_request([1] * 16, params(12), priority=5)
    engine.step()
    high = engine.add_request([2] * 16, params(12), priority=0)
    engine.run()
    assert low.num_preemptions == 0 and low.finish_step < high.first_scheduled_step


def test_preempted_requests_keep_their_place_by_priority_and_arrival():
    engine = policy_engine("priority", num_kv_blocks=64, max_num_seqs=2)
    a = engine.add_request([1] * 4, params(30), priority=3)
    b = engine.add_request([2] * 4, params(30), priority=3)
    engine.step()
    c = engine.add_request([3] * 4, params(30), priority=4)       # waits: worse than both
    hi = [engine.add_request([4 + i] * 4, params(5), priority=0) for i in range(2)]
    engine.step()                               # both running ones make room, c is never admitted
    assert {r.request_id for r in engine.scheduler.running} == {h.request_id for h in hi}
    policy = engine.scheduler.policy
    assert sorted(engine.scheduler.waiting, key=policy.key) == [a, b, c]
    engine.run()
    assert a.first_scheduled_step < c.first_scheduled_step and b.finish_step <= c.finish_step


# --- aging -----------------------------------------------------------------------------
def starving_workload(engine, horizon=2.0, rate=40.0):
    """One place; a steady stream of priority-0 requests that keeps it busy, and
    one priority-1 request that arrives just after the stream begins."""
    n = int(horizon * rate)
    stream = [engine.add_request([1] * 16, params(32), priority=0, arrival_time=i / rate) for i in range(n)]
    low = engine.add_request([2] * 16, params(32), priority=1, arrival_time=0.5 / rate)
    return stream, low


def test_without_aging_a_low_priority_request_starves_and_aging_cures_it():
    horizon = 2.0
    engine = policy_engine("priority", num_kv_blocks=64, max_num_seqs=1)
    stream, low = starving_workload(engine, horizon)
    while engine.now() < horizon:
        engine.step()
    served = sum(r.first_scheduled_step is not None for r in stream)
    assert served > 5 and low.first_scheduled_step is None       # it never ran within the horizon
    engine.run()
    assert_all_memory_back(engine)

    aging = 0.1
    engine = policy_engine("priority", num_kv_blocks=64, max_num_seqs=1, priority_aging_s=aging)
    stream, low = starving_workload(engine, horizon)
    engine.run()
    assert all(r.is_finished for r in [*stream, low])
    start = engine.trace[low.first_scheduled_step].sim_start
    assert start < horizon
    # The bound: low is ahead of every request arriving after arrival + aging_s, so it
    # starts once the requests that arrived before then are done (one at a time here).
    ahead = [r for r in stream if r.arrival_time["sim"] <= low.arrival_time["sim"] + aging]
    assert start <= max(engine.trace[r.finish_step].sim_end for r in ahead) + 1e-9
    assert_all_memory_back(engine)


def test_aging_is_a_fixed_deadline_order():
    pol = PriorityPolicy(aging_s=2.0)
    a = Request("a", [1], params(1), priority=3, arrival_time={"sim": 0.0})
    b = Request("b", [1], params(1), priority=0, arrival_time={"sim": 5.0})
    pol.on_arrival(a, []), pol.on_arrival(b, [])
    for now in (5.0, 5.5, 6.5, 9.0, 100.0):       # a's deadline 0 + 3*2 = 6 > b's 5 + 0 = 5
        pol.now = now
        assert pol.effective_priority(a) == 3 - now / 2 and pol.beats(b, a)


# --- fair share (VTC) -----------------------------------------------------------------
def service(reqs, client, w_p=1.0, w_q=2.0):
    """Weighted tokens served to a client: prompts of admitted requests, outputs so far."""
    return sum(w_p * r.num_prompt_tokens + w_q * r.num_output_tokens
               for r in reqs if r.client_id == client and r.first_scheduled_step is not None)


def backlogged(reqs, client):
    return any(r.client_id == client and r.status == RequestStatus.WAITING and r.first_scheduled_step is None
               for r in reqs)


def max_gap_while_backlogged(engine, reqs):
    """Largest |service(a) - service(b)| over the steps at which both clients have
    requests waiting (both backlogged since time 0, counters both 0 then)."""
    gap = 0.0
    while engine.has_unfinished():
        engine.step()
        if not (backlogged(reqs, "a") and backlogged(reqs, "b")):
            break
        gap = max(gap, abs(service(reqs, "a") - service(reqs, "b")))
    return gap


@settings(max_examples=25, deadline=None)
@given(a=st.lists(st.tuples(st.integers(1, 48), st.integers(1, 48)), min_size=6, max_size=30),
       b=st.lists(st.tuples(st.integers(1, 48), st.integers(1, 48)), min_size=6, max_size=30),
       blocks=st.integers(24, 64), seqs=st.integers(1, 8))
def test_vtc_keeps_two_backlogged_clients_within_the_bound(a, b, blocks, seqs):
    """Sheng et al.'s Theorem: two continuously backlogged clients receive service
    within 2U of each other over any interval, U = max(w_p L_input, w_q M), with
    L_input the longest prompt and M the most tokens a running batch holds (here
    the whole KV pool). Both start backlogged at time 0 with counters 0, so the
    service received by each since then is its counter: we check that the
    service gap stays within 2U at every step while both are backlogged."""
    engine = policy_engine("fair", num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=64)
    reqs = []
    for i in range(max(len(a), len(b))):           # interleaved arrivals, all at time 0
        for name, lens in (("a", a), ("b", b)):
            if i < len(lens):
                reqs.append(engine.add_request([1 + i] * lens[i][0], params(lens[i][1]), client_id=name))
    policy = engine.scheduler.policy
    U = max(policy.w_p * max(r.num_prompt_tokens for r in reqs), policy.w_q * blocks * 4)
    assert max_gap_while_backlogged(engine, reqs) <= 2 * U
    engine.run()
    assert_all_memory_back(engine)


def test_fcfs_breaks_the_vtc_bound_where_vtc_keeps_it():
    """The check above can fail: one client that sent first takes everything under FCFS."""
    gaps = {}
    for policy in ("fcfs", "fair"):
        engine = policy_engine(policy, num_kv_blocks=32, max_num_seqs=4)
        reqs = [engine.add_request([1] * 16, params(16), client_id="a") for _ in range(40)]
        reqs += [engine.add_request([2] * 16, params(16), client_id="b") for _ in range(40)]
        gaps[policy] = max_gap_while_backlogged(engine, reqs)
    U = max(16, 2 * 32 * 4)
    assert gaps["fair"] <= 2 * U < gaps["fcfs"]


def test_vtc_lifts_a_returning_client_and_honours_weights():
    pol = FairSharePolicy(weights={"gold": 2.0})
    mk = lambda rid, client, p=10: Request(rid, [1] * p, params(1), client_id=client)  # noqa: E731
    a1, b1 = mk("a1", "a"), mk("b1", "b")
    pol.on_arrival(a1, []), pol.on_arrival(b1, [a1])
    pol.on_admit(a1)
    assert pol.counter("a") == 10 and pol.counter("b") == 0
    pol.on_admit(b1)                                 # b's queue empties last
    b2 = mk("b2", "b", 100)
    pol.on_arrival(b2, [])
    pol.on_admit(b2)                                  # b: 10 + 100
    a2 = mk("a2", "a")
    pol.on_arrival(a2, [])                            # nobody queued: lift a to b's counter (b emptied last)
    assert pol.counter("a") == 110
    c1 = mk("c1", "c")
    pol.on_arrival(c1, [a2])                          # c was never seen: lifted to the queued minimum
    assert pol.counter("c") == 110
    g = mk("g1", "gold")
    pol.on_arrival(g, [a2, c1])
    before = pol.counter("gold")
    pol.on_admit(g)
    assert pol.counter("gold") - before == 10 / 2     # weight 2: half the charge


# --- workloads, bench and the command line ---------------------------------------------
def test_class_and_client_workloads():
    from minibatch_engine.harness.workload import make_workload, parse_clients
    specs = make_workload("mixed-classes", 200, seed=1, arrival_rate=10.0)
    by = {c: [s for s in specs if s.request_class == c] for c in ("interactive", "batch")}
    assert len(by["interactive"]) > len(by["batch"]) > 0
    assert {s.priority for s in by["interactive"]} == {0} and {s.priority for s in by["batch"]} == {1}
    assert max(len(s.prompt_token_ids) for s in by["interactive"]) < min(len(s.prompt_token_ids) for s in by["batch"])
    assert parse_clients("a:8,b:1") == {"a": 8.0, "b": 1.0}
    for bad in ("a", "a:0", "a:x", "a:1,a:2"):
        with pytest.raises(ValueError, match="name:rate"):
            parse_clients(bad)
    specs = make_workload("uniform", 300, seed=0, clients={"a": 8.0, "b": 1.0, "c": 1.0})
    counts = {c: sum(s.client_id == c for s in specs) for c in "abc"}
    assert counts["a"] > 4 * max(counts["b"], counts["c"]) and min(counts.values()) > 0
    assert [s.arrival_time for s in specs] == sorted(s.arrival_time for s in specs)
    assert make_workload("uniform", 5, seed=3)[0].prompt_token_ids == make_workload("uniform", 5, seed=3)[0].prompt_token_ids
    with pytest.raises(ValueError, match="not both"):
        make_workload("uniform", 5, arrival_rate=1.0, clients={"a": 1.0})


def test_bench_reports_per_class_and_per_client(tmp_path, capsys):
    import json

    from minibatch_engine.entrypoints.cli import main
    path = tmp_path / "s.json"
    assert main(["simulate", "--workload", "mixed-classes", "--num-requests", "40", "--arrival-rate", "20",
                 "--max-batch", "4", "--policy", "priority", "--priority-aging-s", "2", "--no-progress",
                 "--json", str(path)]) == 0
    report = capsys.readouterr().out
    assert "per class" in report and "interactive" in report and "priority, aging 2 s" in report
    s = json.loads(path.read_text())
    assert s["policy"] == "priority" and set(s["per_class"]) == {"interactive", "batch"}
    g = s["per_class"]["interactive"]
    assert g["slo_ttft_s"] == 0.25 and 0 <= g["slo_attainment"] <= 1 and g["ttft_p50_s"] <= g["ttft_p99_s"]
    assert sum(c["requests"] for c in s["per_class"].values()) == 40
    assert sum(c["tokens_served"] for c in s["per_class"].values()) == \
        s["output_tokens"] + sum(c["prompt_tokens"] for c in s["per_class"].values())
    assert main(["simulate", "--clients", "a:8,b:1", "--num-requests", "30", "--policy", "fair",
                 "--slo-ttft-ms", "1e9", "--slo-e2e-ms", "1e9", "--no-progress", "--json", str(path)]) == 0
    s = json.loads(path.read_text())
    assert set(s["per_client"]) == {"a", "b"} and all(c["slo_attainment"] == 1 for c in s["per_client"].values())
    assert main(["simulate", "--priority-aging-s", "1", "--no-progress"]) == 2
    assert "needs policy='priority'" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_forgetting_a_request_empties_what_the_policy_kept(policy):
    """Engine.forget (a long-running server's call) reaches the policy: nothing
    about a forgotten request stays in its bookkeeping."""
    eng = policy_engine(policy)
    reqs = [eng.add_request([1, 2, 3, 4, 5], params(6), client_id=c) for c in ("a", "b", "a")]
    eng.run()
    for r in reqs:
        eng.forget(r.request_id)
    pol = eng.scheduler.policy
    assert eng.scheduler.requests == {} and pol._seq == {}
    if isinstance(pol, FairSharePolicy):
        assert pol._charged_out == {} and pol._charged_in == set()
        assert set(pol.counters) == {"a", "b"}      # per-client service stays: it is the policy's state
