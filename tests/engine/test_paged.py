"""PagedAttention: the block manager's bookkeeping, and exact tokens through pages,
prefix sharing, copy-on-write forks and preemption."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch_engine import Engine, EngineConfig, SamplingParams, reference_generate
from minibatch_engine.kv import BlockManager, PagedKVCache
from minibatch_engine.model import get_preset

from ..conftest import SIM


ops = st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "free", "compute"]),
                         st.integers(0, 7), st.integers(1, 40)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.integers(1, 6), collide=st.booleans())
def test_block_manager_random_operations(ops, num_blocks, block_size, collide):
    """Random allocate / grow / fork / free / compute sequences: no block leaked,
    none owned twice, reference counts match the tables, all free at the end."""
    kwargs = {"hash_fn": (lambda parent, tokens: 0)} if collide else {}
    m = BlockManager(num_blocks, block_size, **kwargs)
    tokens, computed = {}, {}
    for op, k, n in ops:
        rid = f"r{k}"
        if op == "new" and rid not in m.block_tables:
            toks = [t % 3 for t in range(n)]            # few distinct tokens: many prefix hits
            free_before, refs_before = m.num_free_blocks, [b.ref_count for b in m.blocks]
            found, hit = m.find_cached_prefix(toks)
            # the lookup takes nothing: same free list, same reference counts
            assert m.num_free_blocks == free_before and [b.ref_count for b in m.blocks] == refs_before
            assert hit % block_size == 0 and hit < n and hit == len(found) * block_size
            assert tuple(toks[:hit]) == tuple(t for b in found for t in m.blocks[b].tokens)
            if m.allocate(rid, n, prefix=found):
                assert m.block_tables[rid][:len(found)] == found
                tokens[rid], computed[rid] = toks, hit
            else:                                        # a failed allocate changes nothing
                assert rid not in m.block_tables and m.num_free_blocks == free_before
                assert [b.ref_count for b in m.blocks] == refs_before
        elif op == "grow" and rid in tokens:
            tokens[rid] = tokens[rid] + [n % 3]
            copies = m.copy_on_write(rid, computed[rid]) if m.num_free_blocks >= len(m.block_tables[rid]) else []
            assert all(m.blocks[dst].ref_count == 1 for _, dst in copies)
            m.allocate(rid, len(tokens[rid]))
        elif op == "compute" and rid in tokens:
            have = len(m.block_tables[rid]) * block_size
            new = min(len(tokens[rid]), have)
            m.mark_computed(rid, tokens[rid], new, computed[rid])
            computed[rid] = max(computed[rid], new)
        elif op == "fork" and rid in tokens:
            child = f"{rid}.{n}"
            if child not in m.block_tables:
                m.fork(rid, child)
                tokens[child], computed[child] = list(tokens[rid]), computed[rid]
        elif op == "free" and rid in tokens:
            m.free_request(rid)
            del tokens[rid], computed[rid]
        m.check_invariants()
        for table in m.block_tables.values():
            assert len(table) == len(set(table)), "a block twice in one table"
    for rid in list(m.block_tables):
        m.free_request(rid)
    m.check_invariants()
    assert m.num_free_blocks == num_blocks and m.used_tokens() == 0


def run(tiny, prompts, outs, **cfg):
    engine = Engine(tiny, EngineConfig(scheduler="continuous", max_model_len=96, **cfg))
    reqs = [engine.add_request(p, SamplingParams(max_tokens=g, ignore_eos=True)) for p, g in zip(prompts, outs)]
    engine.run()
    return engine, [r.output_token_ids for r in reqs]


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=2, max_size=7),
       block_size=st.sampled_from([1, 3, 8, 16]), shared=st.integers(0, 20))
def test_paged_equals_reserved_equals_recompute(tiny64, lengths, block_size, shared):
    torch.manual_seed(block_size + shared)
    prefix = torch.randint(0, 256, (shared,)).tolist()      # a common system prompt
    prompts = [prefix + torch.randint(0, 256, (p,)).tolist() for p, _ in lengths]
    outs = [g for _, g in lengths]
    _, reserved = run(tiny64, prompts, outs, max_num_seqs=3)
    eng, paged = run(tiny64, prompts, outs, max_num_seqs=3, kv_layout="paged", block_size=block_size)
    # internal fragmentation: less than one block per running sequence
    for s in eng.trace.steps:
        assert 0 <= s.kv_fragmentation_bytes < max(1, s.num_scheduled + 1) * block_size * eng.kv_cache.bytes_per_token
    _, no_cache = run(tiny64, prompts, outs, max_num_seqs=3, kv_layout="paged", block_size=block_size,
                      enable_prefix_caching=False)
    assert reserved == paged == no_cache == [reference_generate(tiny64, p, g) for p, g in zip(prompts, outs)]
    assert eng.kv_cache.manager.num_used_blocks == 0
    eng.kv_cache.manager.check_invariants()


def test_prefix_sharing_skips_prefill_and_survives_collisions(tiny64):
    torch.manual_seed(0)
    system = torch.randint(0, 256, (40,)).tolist()
    prompts = [system + torch.randint(0, 256, (5,)).tolist() for _ in range(4)]
    ref = [reference_generate(tiny64, p, 6) for p in prompts]
    for hash_fn in (None, lambda parent, tokens: 7):        # a hash that always collides
        engine = Engine(tiny64, EngineConfig(scheduler="continuous", max_num_seqs=1, max_model_len=96,
                                             kv_layout="paged", block_size=8))
        if hash_fn is not None:
            engine.kv_cache.manager.hash_fn = hash_fn
        reqs = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
        engine.run()
        assert [r.output_token_ids for r in reqs] == ref
        hits = [r.num_cached_tokens for r in reqs]
        if hash_fn is None:
            assert hits == [0, 40, 40, 40]                   # 5 full blocks of the system prompt
            assert engine.trace.computed_tokens == sum(len(p) + 5 for p in prompts) - 120


def test_parallel_sampling_forks_with_copy_on_write(tiny64):
    prompt = list(b"fork me, please")                      # 15 tokens: last block partly filled
    engine = Engine(tiny64, EngineConfig(scheduler="continuous", max_num_seqs=4, max_model_len=64,
                                         kv_layout="paged", block_size=4))
    parent = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.8, seed=11, n=3,
                                                       ignore_eos=True))
    engine.step()                                          # prefill once, then fork
    m = engine.kv_cache.manager
    tables = [m.block_tables[r.request_id] for r in engine.samples_of(parent.request_id)]
    assert tables[0] == tables[1] == tables[2] and all(m.blocks[b].ref_count == 3 for b in tables[0])
    engine.run()
    samples = [r.output_token_ids for r in engine.samples_of(parent.request_id)]
    assert len(samples) == 3 and len(set(map(tuple, samples))) > 1
    # sample k equals a lone request seeded seed + k; the prompt was computed once
    for k, toks in enumerate(samples):
        alone = Engine(tiny64, EngineConfig(scheduler="continuous", max_num_seqs=1, max_model_len=64))
        r = alone.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.8, seed=11 + k, ignore_eos=True))
        alone.run()
        assert r.output_token_ids == toks
    assert engine.trace[0].computed_tokens == len(prompt)
    assert m.num_used_blocks == 0
    m.check_invariants()


def test_greedy_parallel_samples_equal_reference(tiny64):
    from minibatch_engine import LLM
    llm = LLM(tiny64, kv_layout="paged", scheduler="continuous", max_num_seqs=4, block_size=4)
    out = llm.generate([list(b"abcdefg")], SamplingParams(max_tokens=9, n=3, ignore_eos=True), use_tqdm=False)[0]
    ref = reference_generate(tiny64, list(b"abcdefg"), 9)
    assert [o.token_ids for o in out.outputs] == [ref] * 3
    assert [o.index for o in out.outputs] == [0, 1, 2] and out.finished


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 16)), min_size=2, max_size=6),
       blocks=st.integers(10, 14))
def test_preemption_under_a_tiny_budget_loses_nothing(tiny64, lengths, blocks):
    torch.manual_seed(blocks)
    prompts = [torch.randint(0, 256, (p,)).tolist() for p, _ in lengths]
    outs = [g for _, g in lengths]
    eng, got = run(tiny64, prompts, outs, max_num_seqs=4, kv_layout="paged", block_size=4, num_kv_blocks=blocks,
                   watermark=0.0)
    assert got == [reference_generate(tiny64, p, g) for p, g in zip(prompts, outs)]
    assert eng.kv_cache.manager.num_used_blocks == 0


def test_request_larger_than_the_whole_cache_is_refused(tiny64):
    engine = Engine(tiny64, EngineConfig(scheduler="continuous", max_model_len=256, kv_layout="paged",
                                         block_size=16, num_kv_blocks=4))
    with pytest.raises(ValueError, match="can never fit the KV cache"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=10))
    engine.add_request([1] * 50, SamplingParams(max_tokens=14))      # exactly 64 tokens: fits
    with pytest.raises(ValueError, match="n > 1"):
        Engine(tiny64, max_num_seqs=2, kv_layout="reserved").add_request([1], SamplingParams(n=2))
    with pytest.raises(ValueError, match="static"):
        EngineConfig(scheduler="static", kv_layout="paged")


def test_budget_in_bytes_sets_rows_and_blocks():
    cfg = get_preset("llama-3-8b")
    per_token = cfg.kv_bytes_per_token(2)
    budget = 100 * 1024 * per_token                  # 100 rows of 1024 tokens
    reserved = Engine(None, EngineConfig(scheduler="continuous", max_num_seqs=256, max_model_len=1024,
                                         kv_budget_bytes=budget, kv_layout="reserved", **SIM))
    paged = Engine(None, EngineConfig(scheduler="continuous", max_num_seqs=256, max_model_len=1024,
                                      kv_budget_bytes=budget, kv_layout="paged", **SIM))
    assert reserved.kv_cache.num_rows == 100
    assert paged.kv_cache.num_blocks == 100 * 1024 // 16
    assert reserved.kv_cache.capacity_bytes == paged.kv_cache.capacity_bytes == budget


def test_paged_memory_accounting():
    cache = PagedKVCache(get_preset("tiny"), num_blocks=8, block_size=4, watermark=0.0)
    assert cache.allocate("a", 6, headroom=cache.watermark_blocks)    # 2 blocks
    cache.mark_computed("a", list(range(6)), 6)
    assert cache.reserved_bytes == 8 * cache.bytes_per_token
    assert cache.used_bytes == 6 * cache.bytes_per_token       # 2 token places of internal fragmentation
    cache.free("a")
    assert cache.reserved_bytes == 0


def test_first_block_names_where_a_request_starts():
    """The trace's lane key: the first block (paged) or row (reserved), -1 without memory."""
    from minibatch_engine.kv import ReservedKVCache
    paged = PagedKVCache(get_preset("tiny"), num_blocks=8, block_size=4, watermark=0.0)
    assert paged.first_block("a") == -1
    assert paged.allocate("b", 3) and paged.allocate("a", 9)          # b takes block 0, a blocks 1-3
    assert paged.first_block("a") == paged.block_table("a")[0] == 1
    paged.free("a")
    assert paged.first_block("a") == -1
    reserved = ReservedKVCache(get_preset("tiny"), num_rows=3, max_model_len=16)
    assert reserved.first_block("x") == -1
    assert reserved.allocate("x", 5) and reserved.allocate("y", 5)
    assert reserved.first_block("y") == reserved.block_table("y")[0] == 1
    reserved.free("y")
    assert reserved.first_block("y") == -1


@pytest.mark.parametrize("kv_layout", ["paged", "reserved"])
def test_trace_lanes_keep_their_block_on_the_finishing_step(tiny32, kv_layout):
    """Every computed lane names the block it was computed in, the last step of
    a request included (its blocks are freed only after the step is recorded)."""
    engine = Engine(tiny32, EngineConfig(scheduler="continuous", kv_layout=kv_layout,
                                       max_model_len=64, max_num_seqs=3))
    for i, n in enumerate((3, 7, 5, 2)):
        engine.add_request([1 + i] * 4, SamplingParams(max_tokens=n, ignore_eos=True))
    engine.run()
    last = {lane.request_id: lane for rec in engine.trace.steps for lane in rec.lanes}
    assert len(last) == 4
    assert all(lane.first_block >= 0 for rec in engine.trace.steps for lane in rec.lanes)
