"""Every attention backend equals the reference: on random ragged batches over a
paged pool, and inside the whole model (greedy tokens equal full recompute)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch_engine.attention import (AttentionMetadata, BatchMetadata, get_attention_backend)
from minibatch_engine.attention.registry import triton_available
from minibatch_engine.attention.cpu_kernel import cpu_kernel_available
from minibatch_engine.attention.sdpa import SdpaBackend, length_buckets
from minibatch_engine.kv import KVPool, PagedKVCache
from minibatch_engine.model import full_forward_logits, reference_generate

from .attention_cases import assert_matches_reference, random_batch

# the reference is the ground truth the others are checked against (and tests/test_paged.py
# checks it against full recompute), so only the other CPU backends are listed here
CPU_BACKENDS = ["sdpa", "cpp"]


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backend_equals_reference_on_random_ragged_batches(name, dtype):
    backend = get_attention_backend(name, "cpu")
    gen = torch.Generator().manual_seed(17)
    for kind in ("decode", "prefill", "mixed"):
        for block_size in (1, 3, 16, 32):
            for heads, kv_heads in ((4, 4), (4, 2), (8, 2)):
                case = random_batch(gen, kind, block_size, heads, kv_heads, 16, dtype, num_seqs=6)
                assert_matches_reference(backend, case)
                assert_matches_reference(backend, case, cache=False)


def test_sdpa_buckets_of_every_waste_are_exact():
    """Bucketing changes only the padding, never the result: one bucket per
    sequence, the default, and a single bucket (everything padded) agree."""
    gen = torch.Generator().manual_seed(3)
    case = random_batch(gen, "mixed", 4, 4, 2, 16, torch.float64, num_seqs=12, max_len=60)
    for waste in (0.0, 0.125, 0.999):
        assert_matches_reference(SdpaBackend(max_waste=waste), case)


@settings(max_examples=60, deadline=None)
@given(blocks=st.lists(st.integers(1, 30), min_size=1, max_size=40), waste=st.sampled_from([0, 0.125, 0.5]))
def test_length_buckets_partition_and_bound_the_padding(blocks, waste):
    buckets = length_buckets(blocks, waste)
    assert sorted(i for b in buckets for i in b) == list(range(len(blocks)))
    for b in buckets:
        padded = len(b) * max(blocks[i] for i in b)
        assert padded - sum(blocks[i] for i in b) <= waste * padded + 1e-9
        assert blocks[b[0]] == max(blocks[i] for i in b)


def test_get_attention_backend_names_and_errors(monkeypatch):
    assert get_attention_backend("auto", "cpu").name == ("cpp" if cpu_kernel_available() else "sdpa")
    assert get_attention_backend("reference").name == "reference"
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")
    if triton_available():
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="runs on CUDA"):
            get_attention_backend("triton", "cpu")
    else:
        with pytest.raises(ValueError, match="needs the triton package"):
            get_attention_backend("triton", "cpu")


def test_metadata_runs_only_on_its_own_backend():
    q, k = torch.zeros(3, 2, 8), torch.zeros(3, 1, 8)
    meta = get_attention_backend("sdpa").build_metadata([3], [3])
    assert isinstance(meta, BatchMetadata) and meta.backend.name == "sdpa"
    with pytest.raises(ValueError, match="built by the 'sdpa' backend"):
        get_attention_backend("reference").forward(q, k, k, meta)
    with pytest.raises(ValueError, match="needs a KV cache"):
        meta = get_attention_backend("sdpa").build_metadata([3], [3], [[0]], 4)
        meta.backend.forward(q, k, k, meta)
    assert AttentionMetadata.build([3], [3]).backend.name == "reference"


@torch.no_grad()
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_cache_free_forward_equals_reference_metadata(tiny64, name):
    """Three sequences recomputed in one cache-free forward through the backend
    give, for every position, the logits of ``AttentionMetadata`` alone."""
    backend = get_attention_backend(name)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 1, 23)]
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.tensor([p for s in seqs for p in range(len(s))])
    lens = [len(s) for s in seqs]
    logits = tiny64(ids, pos, backend.build_metadata(lens, lens), None, all_logits=True)
    ref = torch.cat([full_forward_logits(tiny64, s) for s in seqs])
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-10)


@torch.no_grad()
def paged_greedy(model, backend, prompts, max_new, block_size, chunk):
    """A tiny continuous batcher by hand: every step each sequence brings up to
    ``chunk`` prompt tokens (chunked prefill) or its last sampled token (decode),
    all in one forward over a paged cache. Returns each sequence's greedy tokens."""
    num_blocks = sum(-(-(len(p) + max_new) // block_size) for p in prompts)
    cache = PagedKVCache(model.config, num_blocks=num_blocks, block_size=block_size, dtype=model.dtype,
                         enable_prefix_caching=False)
    pool = KVPool.for_cache(cache, model.config, model.dtype, model.device)
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)                 # tokens whose K/V are in the cache
    out = [[] for _ in prompts]
    while any(len(o) < max_new for o in out):
        ids, pos, ql, sl, tables, rows = [], [], [], [], [], []
        for i, toks in enumerate(tokens):
            if len(out[i]) >= max_new:
                continue
            n = min(chunk, len(toks) - done[i])
            assert cache.allocate(str(i), done[i] + n)
            ids += toks[done[i]:done[i] + n]
            pos += range(done[i], done[i] + n)
            ql.append(n), sl.append(done[i] + n), tables.append(cache.block_table(str(i)))
            rows.append(i)
            done[i] += n
        meta = backend.build_metadata(ql, sl, tables, block_size, model.device)
        dev = model.device
        logits = model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, pool)
        for row, i in enumerate(rows):
            if done[i] == len(tokens[i]):     # prompt fully in: this step samples
                t = int(logits[row].argmax())
                out[i].append(t)
                tokens[i].append(t)
    return out


@pytest.mark.parametrize("name", CPU_BACKENDS)
@pytest.mark.parametrize("block_size,chunk", [(1, 64), (4, 5), (16, 7)])
def test_paged_greedy_tokens_equal_full_recompute(tiny64, name, block_size, chunk):
    gen = torch.Generator().manual_seed(block_size)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 12, 30, 5)]
    got = paged_greedy(tiny64, get_attention_backend(name), prompts, 6, block_size, chunk)
    assert got == [reference_generate(tiny64, p, 6) for p in prompts]
