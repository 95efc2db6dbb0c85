"""The pieces of chapter 12's router comparison that run without a router:
the fitted workloads, their text form, and the simulator fed the very
requests a live run sends (``harness/router_compare.py``)."""
from minibatch_engine.cluster.colocated import simulate_cluster
from minibatch_engine.harness import router_compare as rc
from minibatch_engine.harness.workload import make_workload
from minibatch_engine.model.registry import tokenizer_for
from minibatch_engine.model.trained import trained_model_path


def test_fitted_prompts_fit_tiny_py_and_keep_their_shared_prefixes():
    specs = rc.fitted_workload("system-prompts", 24, seed=0, rate=4.0)
    drawn = make_workload("system-prompts", 24, seed=0, vocab_size=rc.ALPHABET, arrival_rate=4.0)
    assert all(len(s.prompt_token_ids) + s.max_tokens <= rc.MAX_MODEL_LEN for s in specs)
    assert any(len(s.prompt_token_ids) < len(d.prompt_token_ids) for s, d in zip(specs, drawn))  # some were cut
    for s, d in zip(specs, drawn):
        assert d.prompt_token_ids[:len(s.prompt_token_ids)] == s.prompt_token_ids   # only the tail goes
        assert (s.max_tokens, s.arrival_time, s.request_class) == (d.max_tokens, d.arrival_time, d.request_class)


def test_the_text_a_router_sees_is_the_prompt_the_server_runs():
    tok = tokenizer_for(trained_model_path(rc.MODEL))
    for s in rc.fitted_workload("multi-turn", 6, seed=1, rate=4.0):
        text = rc.render(s)["prompt"]
        assert text.isprintable()
        assert tok.encode(text) == [32 + t for t in s.prompt_token_ids]
        assert rc.session(s) == {"X-Session-Id": s.client_id}


def test_simulate_cluster_runs_given_requests_as_it_runs_its_own_draw():
    specs = make_workload("multi-turn", 24, seed=3, vocab_size=256, arrival_rate=4.0)
    drawn, _ = simulate_cluster(2, "prefix", "multi-turn", 24, arrival_rate=4.0, seed=3)
    given, _ = simulate_cluster(2, "prefix", "multi-turn", specs=specs, arrival_rate=4.0, seed=3)
    assert given == drawn
    half, _ = simulate_cluster(2, "prefix", "multi-turn", specs=specs[:12], arrival_rate=4.0, seed=3)
    assert half["num_requests"] == 12 and sum(r["requests"] for r in half["per_replica"]) == 12


def test_every_live_router_names_a_simulated_one_or_none():
    assert set(rc.NEAREST) == {("vllm-router", p) for p in rc.VLLM_POLICIES} | {("route", p) for p in rc.BOOK_POLICIES}
    assert {v for v in rc.NEAREST.values() if v is not None} <= set(rc.SIMULATED)
