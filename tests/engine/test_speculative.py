"""Speculative decoding inside continuous batching (chapter 9): greedy output equals
a lone full recompute whatever is proposed and however it is scheduled; rejection
sampling keeps the target's distribution; rejected tokens leave no KV block
and no prefix-cache entry behind."""
import pytest
import torch

from minibatch_engine import Engine, EngineConfig, SamplingParams, build_model, reference_generate
from minibatch_engine import SpeculativeConfig
from minibatch_engine.core.request import RequestStatus
from minibatch_engine.speculative import ngram_propose, rejection_sample, verify_greedy

from ..conftest import assert_all_memory_back

MAX_TOKENS = 12
# repetitive prompts (n-gram hits), one shared 8-token prefix (prefix-cache hits)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [9, 8, 9, 8, 9, 8, 7, 6, 5],
           [1, 2, 3, 4, 1, 2, 3, 4, 50, 60, 70, 50], list(range(20, 34))]


@pytest.fixture(scope="module")
def refs(tiny64):
    return [reference_generate(tiny64, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def other_draft():
    """A draft that disagrees with the target almost always: many rejections."""
    return build_model("tiny", device="cpu", dtype="float64", seed=1)


def small(**cfg):
    """A small KV pool (the defaults size it for 256 sequences of 1024 tokens)."""
    return EngineConfig(**{"max_num_seqs": 8, "max_model_len": 64, **cfg})


def run(model, spec, prompts=PROMPTS, max_tokens=MAX_TOKENS, check=None, **cfg):
    engine = Engine(model, small(speculative=spec, **cfg))
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        if check is not None:
            check(engine)
        steps += 1
        assert steps < 500, "no progress"
    return engine, reqs


def assert_blocks_match_computed(engine):
    """After every step, each running request holds exactly the blocks of its
    computed tokens: the slots of rejected proposals were given back."""
    m = engine.kv_cache.manager
    m.check_invariants()
    for r in engine.scheduler.running:
        assert len(m.table(r.request_id)) == m.blocks_for(r.num_computed_tokens), r


def assert_prefix_cache_holds_only_real_tokens(engine, reqs):
    """Every registered block, read with its chain of parents, is a prefix of
    some request's final tokens: no rejected proposal was ever cached."""
    m = engine.kv_cache.manager
    real = {tuple(r.all_token_ids[:(i + 1) * m.block_size]) for r in reqs
            for i in range(r.num_tokens // m.block_size)}
    for h, block_id in m.cached.items():
        chain, b = [], m.blocks[block_id]
        while b is not None:
            chain = list(b.tokens) + chain
            b = m.blocks[b.parent] if b.parent is not None else None
        assert tuple(chain) in real, f"cached block {block_id} holds tokens no request has"


CONFIGS = {
    "default": dict(),                                            # chunked budget 2048 + prefix caching
    "chunked": dict(max_num_batched_tokens=6, max_num_seqs=4, block_size=4),
    "recompute": dict(block_size=4, num_kv_blocks=14, watermark=0.0, max_num_batched_tokens=16, max_num_seqs=4),
    "swap": dict(block_size=4, num_kv_blocks=14, watermark=0.0, preemption_mode="swap",
                 swap_space_bytes=64 * 4 * 2 * 4 * 2 * 64 * 8),
    "reserved": dict(kv_layout="reserved", max_model_len=64, enable_prefix_caching=False),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_other"])
def test_greedy_equals_lone_full_recompute(tiny64, other_draft, refs, method, config):
    if method == "ngram":
        spec = SpeculativeConfig("ngram", 3)
    else:
        spec = SpeculativeConfig("draft_model", 3, draft_model=tiny64 if method == "draft_same" else other_draft)
    check = assert_blocks_match_computed if CONFIGS[config].get("kv_layout") != "reserved" else None
    engine, reqs = run(tiny64, spec, check=check, **CONFIGS[config])
    assert [r.output_token_ids for r in reqs] == refs
    assert engine.trace.acceptance_rate() == pytest.approx(
        sum(s.spec_accepted for s in engine.trace.steps) / sum(s.spec_proposed for s in engine.trace.steps))
    if method == "draft_same":              # the target proposing for itself: every guess accepted
        assert engine.trace.acceptance_rate() == 1.0
    if config == "recompute":
        assert sum(r.num_preemptions for r in reqs) > 0, "the configuration should preempt"
    if config == "swap":
        assert sum(r.num_swaps for r in reqs) > 0, "the configuration should swap"
    if CONFIGS[config].get("kv_layout") != "reserved":
        assert_prefix_cache_holds_only_real_tokens(engine, reqs)
        assert_all_memory_back(engine)


def test_many_rejections_leak_nothing_and_cache_no_rejected_token(tiny64, other_draft):
    prompts = [[7] * 9, [1, 2, 3] * 5, [7] * 9 + [1], list(range(3, 19))]
    spec = SpeculativeConfig("draft_model", 4, draft_model=other_draft)
    engine, reqs = run(tiny64, spec, prompts=prompts, max_tokens=20, block_size=2,
                       check=assert_blocks_match_computed)
    proposed = sum(s.spec_proposed for s in engine.trace.steps)
    rejected = proposed - sum(s.spec_accepted for s in engine.trace.steps)
    assert rejected > 100
    assert [r.output_token_ids for r in reqs] == [reference_generate(tiny64, p, 20) for p in prompts]
    assert_prefix_cache_holds_only_real_tokens(engine, reqs)
    assert_all_memory_back(engine)


def test_stop_token_and_max_tokens_inside_an_accepted_run(tiny64, refs):
    """The target proposing for itself accepts every guess; a stop token among
    them ends the request there, and max_tokens caps the proposals."""
    spec = SpeculativeConfig("draft_model", 4, draft_model=tiny64)
    stop = refs[0][5]
    first = refs[0].index(stop)
    engine = Engine(tiny64, small(speculative=spec))
    a = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop]))
    b = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.run()
    assert a.output_token_ids == refs[0][:first + 1] and str(a.finish_reason) == "stop"
    assert b.output_token_ids == refs[1][:5] and str(b.finish_reason) == "length"
    assert any(len(st.lanes) and st.spec_accepted >= 3 for st in engine.trace.steps)
    assert_all_memory_back(engine)


def test_abort_frees_the_draft_cache(tiny64):
    spec = SpeculativeConfig("draft_model", 2, draft_model=tiny64)
    engine = Engine(tiny64, small(speculative=spec))
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True), request_id="a")
    keep = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True), request_id="b")
    for _ in range(3):
        engine.step()
    assert engine.runner.proposer.kv_cache.first_block("a") >= 0
    engine.abort("a")
    engine.run()
    assert keep.status == RequestStatus.FINISHED
    assert_all_memory_back(engine)


def test_token_budget_counts_proposals(tiny64, refs):
    """Proposals are query tokens: a step never exceeds max_num_batched_tokens."""
    engine, reqs = run(tiny64, SpeculativeConfig("draft_model", 4, draft_model=tiny64),
                       max_num_batched_tokens=5, max_num_seqs=4, block_size=4)
    assert max(s.useful_tokens for s in engine.trace.steps) <= 5
    assert any(s.spec_proposed for s in engine.trace.steps)
    assert [r.output_token_ids for r in reqs] == refs


def test_verify_greedy_and_ngram_lookup():
    assert verify_greedy([5, 6, 9, 1], [5, 6, 7]) == [5, 6, 9]
    assert verify_greedy([5, 6, 7, 1], [5, 6, 7]) == [5, 6, 7, 1]
    assert verify_greedy([4, 6, 7, 1], [5, 6, 7]) == [4]
    # last 2 tokens (3, 4) occurred at 2..3 and 6..7: the latest is used
    assert ngram_propose([1, 3, 4, 9, 8, 3, 3, 4, 5, 6, 3, 4], k=3, min_n=1, max_n=2) == [5, 6, 3]
    assert ngram_propose([1, 2, 3], k=3, min_n=1, max_n=3) == []


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of observed counts against probabilities (upper
    tail of chi-square with len - 1 degrees of freedom)."""
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(probs) - 1) / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("point_mass", [True, False])
def test_rejection_sampling_preserves_the_target_distribution(point_mass):
    """10,000 seeded draws of speculative sampling with k = 2 over a 6-token
    vocabulary. The first token must follow p_0; the second (drawn only when the
    first proposal was accepted) must follow p_1. Each chi-square test rejects at
    p < 0.001, so a correct sampler fails it with probability 0.1% per test over
    random seeds; with this fixed seed the outcome is deterministic. A sampler
    that skipped the residual (sampling p_0 again after a rejection) fails."""
    gen = torch.Generator().manual_seed(0)
    V, k, N = 6, 2, 10_000
    p = torch.softmax(torch.randn(k + 1, V, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(k, V, generator=gen, dtype=torch.float64), -1)
    first, second = torch.zeros(V, dtype=torch.float64), torch.zeros(V, dtype=torch.float64)
    for _ in range(N):
        if point_mass:
            proposals = [2, 3]
            out = rejection_sample(p, proposals, generator=gen)
        else:
            proposals = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
            out = rejection_sample(p, proposals, q, generator=gen)
        first[out[0]] += 1
        if len(out) > 1:
            assert out[0] == proposals[0]
            second[out[1]] += 1
    assert chi_square_p_value(first, p[0]) > 1e-3
    assert chi_square_p_value(second, p[1]) > 1e-3
    # the test has power: the first token's counts are far from the draft's distribution
    assert chi_square_p_value(first, q[0] if not point_mass else torch.full((V,), 1 / V)) < 1e-3


def test_sampling_through_the_engine_is_seeded(tiny64):
    spec = SpeculativeConfig("draft_model", 3, draft_model=tiny64)
    outs = []
    for _ in range(2):
        engine = Engine(tiny64, small(speculative=spec))
        r = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True))
        engine.run()
        outs.append(r.output_token_ids)
        assert len(r.output_token_ids) == 10
        assert_all_memory_back(engine)
    assert outs[0] == outs[1]


def test_simulator_models_acceptance_and_prices_the_draft():
    from minibatch_engine.harness.workload import make_workload
    sims = {}
    for name, spec in [("off", None), ("ngram", SpeculativeConfig("ngram", 3, sim_acceptance_rate=0.7)),
                       ("draft", SpeculativeConfig("draft_model", 3, sim_acceptance_rate=0.7))]:
        engine = Engine(None, EngineConfig(speculative=spec, max_num_seqs=8, sim_gpu="H100-SXM",
                                           sim_model="llama-3-8b"))
        reqs = [engine.add_request(s.prompt_token_ids, s.sampling_params())
                for s in make_workload("uniform", 16, seed=0)]
        engine.run()
        assert all(r.is_finished for r in reqs)
        assert engine.kv_cache.num_used_blocks == 0
        sims[name] = engine
    # k = 3, a = 0.7: expected accepted per verification a + a^2 + a^3 = 1.533 (fewer near max_tokens)
    assert 1.35 < sims["ngram"].trace.mean_accepted_per_verification() < 1.6
    t = {k: e.trace.end_time("sim") for k, e in sims.items()}
    assert t["ngram"] < t["draft"] < t["off"]
    assert sum(s.draft_sim_s for s in sims["draft"].trace.steps) > 0


def test_config_errors():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig("ngram", 0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig("ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="continuous"):
        EngineConfig(scheduler="static", speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match="SpeculativeConfig"):
        EngineConfig(speculative={"method": "ngram"})
    with pytest.raises(ValueError, match="draft_model="):
        Engine(build_model("tiny", device="cpu"), EngineConfig(speculative=SpeculativeConfig("draft_model")))


def test_bench_and_cli_report_speculation(tmp_path):
    import json

    from minibatch_engine.entrypoints.cli import main
    path = tmp_path / "s.json"
    assert main(["simulate", "--num-requests", "8", "--no-progress", "--speculative-method", "ngram",
                 "--num-speculative-tokens", "2", "--json", str(path)]) == 0
    s = json.loads(path.read_text())
    assert s["speculative_method"] == "ngram" and s["num_speculative_tokens"] == 2
    assert 0 < s["acceptance_rate"] < 1 and s["mean_accepted_per_verification"] > 0


def test_llm_front_door_takes_a_speculative_config(tiny64, refs):
    from minibatch_engine import LLM
    llm = LLM(tiny64, max_num_seqs=8, max_model_len=64,
              speculative=SpeculativeConfig("draft_model", 3, draft_model=tiny64))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.trace.acceptance_rate() == 1.0


# --- the proposer in the runner, the draft's KV in the budget (issue 25) -----------------------
def test_the_runner_proposes_after_sampling(tiny64, refs):
    """The step that samples a request's first token already answers with its
    guesses for the next step (the proposer runs in the runner, after sampling),
    and the next step verifies them. The engine holds no proposer."""
    engine = Engine(tiny64, small(speculative=SpeculativeConfig("draft_model", 3, draft_model=tiny64)))
    answers, execute = [], engine.runner.execute
    engine.runner.execute = lambda sched: answers.append(execute(sched)) or answers[-1]
    req = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.step()                                    # the prefill: one token sampled, three guessed
    assert answers[0].sampled_token_ids[req.request_id] == refs[0][:1]
    assert answers[0].spec_token_ids[req.request_id] == refs[0][1:4]   # the target drafting for itself
    assert req.spec_token_ids == refs[0][1:4] and not hasattr(engine, "proposer")
    engine.step()                                    # verifies all three, plus one
    assert req.output_token_ids == refs[0][:5]
    engine.run()
    assert req.output_token_ids == refs[0]
    assert_all_memory_back(engine)


@pytest.mark.parametrize("kv_layout", ["paged", "reserved"])
@pytest.mark.parametrize("budget", [3_866_624, 4_000_000, 5_555_555, 9_000_001])
def test_the_draft_models_kv_is_inside_the_memory_budget(tiny64, kv_layout, budget):
    """kv_budget_bytes covers the target's cache and the draft's together: the
    target gets less than it would alone, and the two caches' capacities add up
    to no more than the budget (whole blocks, rounded down)."""
    alone = Engine(tiny64, small(kv_budget_bytes=budget, kv_layout=kv_layout))
    spec = SpeculativeConfig("draft_model", 3, draft_model=tiny64)
    engine = Engine(tiny64, small(kv_budget_bytes=budget, kv_layout=kv_layout, speculative=spec))
    draft = engine.runner.proposer.kv_cache
    assert engine.kv_cache.capacity_bytes + draft.capacity_bytes <= budget
    assert engine.kv_cache.capacity_bytes < alone.kv_cache.capacity_bytes
    # the draft holds every token the target can, plus k - 1 guesses and a partial block per sequence
    assert draft.num_blocks * draft.block_size >= engine.kv_cache.num_blocks * engine.kv_cache.block_size + 8 * 3
    with pytest.raises(ValueError, match="bytes less the draft model's share"):
        Engine(tiny64, small(kv_budget_bytes=1_300_000, kv_layout=kv_layout, speculative=spec))


@pytest.mark.parametrize("budget", [3_866_624, 5_555_555, 9_000_001])
def test_the_budget_split_is_reported_and_speculation_keeps_its_tokens(tiny64, refs, budget):
    """``Engine.kv_split`` (what the bench and /metrics show) is the two caches
    as built: the draft's blocks count against kv_budget_bytes, and greedy
    tokens stay those of a lone recompute."""
    spec = SpeculativeConfig("draft_model", 3, draft_model=tiny64)
    engine = Engine(tiny64, small(kv_budget_bytes=budget, speculative=spec))
    split, draft = engine.kv_split(), engine.runner.proposer.kv_cache
    assert split["kv_budget_bytes"] == budget
    assert (split["draft_kv_blocks"], split["draft_kv_bytes"]) == (draft.num_blocks, draft.capacity_bytes)
    assert (split["target_kv_blocks"], split["target_kv_bytes"]) == (engine.kv_cache.num_blocks,
                                                                     engine.kv_cache.capacity_bytes)
    assert 0 < split["draft_kv_bytes"] and split["target_kv_bytes"] + split["draft_kv_bytes"] <= budget
    reqs = [engine.add_request(p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for p in PROMPTS]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, draft.num_blocks - draft.manager.num_free_blocks)
    assert [r.output_token_ids for r in reqs] == refs
    assert 0 < peak <= split["draft_kv_blocks"]      # the draft wrote inside its own share
    assert Engine(tiny64, small(kv_budget_bytes=budget)).kv_split()["draft_kv_bytes"] == 0


def test_bench_and_metrics_show_the_budget_split(tiny64):
    """The bench's summary and report, and /metrics, carry the target's and the draft's shares."""
    pytest.importorskip("prometheus_client")
    from minibatch_engine.harness.bench import format_report, summarize
    from minibatch_engine.entrypoints.server.metrics import PrometheusStatLogger, parse_metrics
    spec = SpeculativeConfig("draft_model", 2, draft_model=tiny64)
    engine = Engine(tiny64, small(kv_budget_bytes=5_555_555, speculative=spec))
    split = engine.kv_split()
    logger = PrometheusStatLogger("m")
    logger.set_cache_config(engine)
    m = parse_metrics(logger.exposition().decode())
    assert m['minibatch:kv_budget_bytes{model_name="m"}'] == 5_555_555
    for owner in ("target", "draft"):
        key = f'{{kv_cache="{owner}",model_name="m"}}'
        assert m["minibatch:kv_cache_capacity_bytes" + key] == split[f"{owner}_kv_bytes"]
        assert m["minibatch:kv_cache_blocks" + key] == split[f"{owner}_kv_blocks"]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in PROMPTS[:2]]
    engine.run()
    s = summarize(engine, reqs)
    assert (s["kv_budget_bytes"], s["kv_capacity_bytes"], s["draft_kv_bytes"], s["draft_kv_blocks"]) == (
        5_555_555, split["target_kv_bytes"], split["draft_kv_bytes"], split["draft_kv_blocks"])
    run = {"workload": "two prompts", "num_requests": 2, "seed": 0, "scheduler": "continuous", "max_batch": 8}
    assert f"in {split['draft_kv_blocks']} blocks, of a 5.3 MiB budget" in format_report({**s, **run})


def test_the_simulated_draft_takes_its_share_of_gpu_memory():
    """In the simulator too: a draft model's weights and KV come out of the GPU's
    memory, so the target's KV cache is smaller than without it."""
    from ..conftest import sim_engine
    opts = dict(max_num_seqs=512, max_model_len=8192)
    alone = sim_engine(**opts)
    spec = SpeculativeConfig("draft_model", 4, sim_draft_model="llama-3.2-1b")
    assert sim_engine(speculative=spec, **opts).kv_cache.capacity_bytes < alone.kv_cache.capacity_bytes
