"""Split-KV (Flash-Decoding): the torch reference and the Triton kernels equal
the reference attention, on ragged batches over the paged cache, with contexts
that are not a multiple of the split size.

The Triton tests run through the interpreter on a CPU (``TRITON_INTERPRET=1``
is set at import, as in ``test_attention_triton.py``) and compiled on CUDA.
"""
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from minibatch_engine.attention.split_kv import (  # noqa: E402
    merge_partials,
    partial_attention,
    plan_kv_splits,
    split_kv_attention,
)

from .attention_cases import random_batch, reference  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"


def split_reference(case, split_size, cache=True):
    """The torch split-KV over ``case`` (its caches written as the backends write them)."""
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    if not cache:
        ql = case["query_lens"]
        return split_kv_attention(case["q"], case["k"], case["v"], ql, ql, None, 0, split_size)
    bs = case["block_size"]
    slots = [t[p // bs] * bs + p % bs for t, n, q in
             zip(case["block_tables"], case["seq_lens"], case["query_lens"]) for p in range(n - q, n)]
    kc[slots], vc[slots] = case["k"], case["v"]
    return split_kv_attention(case["q"], kc, vc, case["query_lens"], case["seq_lens"],
                              case["block_tables"], bs, split_size)


def test_merging_chunks_is_exact_softmax_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 2, 8, generator=gen, dtype=torch.float64) for n in (3, 50, 50))
    whole = torch.ones(3, 50, dtype=torch.bool)
    full, _ = partial_attention(q, k, v, whole)
    probs = torch.softmax(torch.einsum("qhd,nhd->hqn", q, k) / 8 ** 0.5, -1)
    torch.testing.assert_close(full, torch.einsum("hqn,nhd->qhd", probs, v), rtol=0, atol=1e-12)
    for size in (1, 7, 16, 49):      # 50 keys: chunks that do not divide them evenly
        parts = [partial_attention(q, k[i:i + size], v[i:i + size], whole[:, i:i + size])
                 for i in range(0, 50, size)]
        merged = merge_partials([o for o, _ in parts], [lse for _, lse in parts])
        torch.testing.assert_close(merged, full, rtol=0, atol=1e-12)


def test_a_chunk_a_row_cannot_see_has_no_weight():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 1, 4, generator=gen, dtype=torch.float64) for n in (2, 6, 6))
    mask = torch.tensor([[True, True, True, False, False, False]] * 2)
    o, lse = partial_attention(q, k[3:], v[3:], mask[:, 3:])
    assert torch.isinf(lse).all() and (o == 0).all()
    first, lse1 = partial_attention(q, k[:3], v[:3], mask[:, :3])
    torch.testing.assert_close(merge_partials([first, o], [lse1, lse]), first, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_torch_split_kv_equals_the_reference(kind):
    gen = torch.Generator().manual_seed(3)
    for block_size, (heads, kv_heads), split in [(1, (2, 2), 5), (16, (4, 2), 16), (4, (4, 1), 7)]:
        case = random_batch(gen, kind, block_size, heads, kv_heads, 8, torch.float64,
                            num_seqs=4, max_len=45)
        torch.testing.assert_close(split_reference(case, split), reference(case)[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(split_reference(case, split, cache=False),
                                   reference(case, cache=False)[0], rtol=0, atol=1e-12)


def test_plan_splits_only_a_small_batch_with_a_long_context():
    assert plan_kv_splits(8, 32768) == (15, 2240)          # batch 1, 8 KV heads: 120 of 132 SMs
    assert plan_kv_splits(64, 32768) == (2, 16384)         # 128 programs, one wave
    assert plan_kv_splits(128, 32768) == (1, 32768)        # two chunks would take two waves
    assert plan_kv_splits(8, 300) == (1, 300)              # too short to be worth a merge
    assert plan_kv_splits(256, 32768) == (1, 32768)        # the SMs are busy already
    splits, size = plan_kv_splits(8, 1000, block_n=64)
    assert size % 64 == 0 and splits * size >= 1000 > (splits - 1) * size
    with pytest.raises(ValueError, match="num_programs"):
        plan_kv_splits(0, 100)


# --- the Triton kernels --------------------------------------------------------------------

@pytest.fixture(scope="module")
def triton_backend_cls():
    pytest.importorskip("triton")
    from minibatch_engine.attention.triton_backend import TritonBackend
    from minibatch_engine.attention.triton_split_kv import split_kv_partial_kernel
    if not ON_CUDA and type(split_kv_partial_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: run this module alone")
    return TritonBackend


@pytest.mark.triton
# mixed batches through the interpreter take about 50 s each on one core: make test-slow
@pytest.mark.parametrize("kind", ["decode", pytest.param("mixed", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_split_kv_equals_the_reference(triton_backend_cls, kind, dtype):
    """Forced chunks of 16 and 32 keys over contexts up to 100 (not multiples of
    either), random block tables, block sizes 1/16, GQA 1/2/4; paged and cache-free."""
    from .attention_cases import assert_matches_reference
    gen = torch.Generator().manual_seed(11)
    for split, block_size, (heads, kv_heads) in [(16, 1, (2, 2)), (32, 16, (4, 2)), (16, 16, (4, 1))]:
        backend = triton_backend_cls(DEVICE, block_m=16, block_n=16, kv_split=split)
        case = random_batch(gen, kind, block_size, heads, kv_heads, 16, dtype, num_seqs=4, max_len=100)
        assert backend.kv_splits(3 * kv_heads, max(case["seq_lens"]))[0] > 1    # the split path runs
        assert any(n % split for n in case["seq_lens"])                         # a ragged last chunk
        assert_matches_reference(backend, case, device=DEVICE)
        assert_matches_reference(backend, case, cache=False, device=DEVICE)


@pytest.mark.triton
def test_triton_auto_splits_a_lone_long_decode(triton_backend_cls, monkeypatch):
    """Batch 1, 600 tokens of context: "auto" splits it (and the result is the
    reference's); a batch with as many programs as SMs is not split."""
    from minibatch_engine.attention import triton_backend as tb
    from .attention_cases import assert_matches_reference
    backend = triton_backend_cls(DEVICE, block_m=16, block_n=16)
    assert backend.kv_split == "auto"
    calls = []
    real = tb.split_kv_attend
    monkeypatch.setattr(tb, "split_kv_attend", lambda *a, **k: calls.append(k["num_splits"]) or real(*a, **k))
    gen = torch.Generator().manual_seed(4)
    case = random_batch(gen, "decode", 16, 4, 2, 16, torch.float64, num_seqs=1, max_len=600)
    case["seq_lens"] = [600]
    case["block_tables"] = [torch.randperm(40, generator=gen).tolist()[:38]]
    case["k_cache"], case["v_cache"] = (torch.randn(40 * 16, 2, 16, generator=gen, dtype=torch.float64)
                                        for _ in range(2))
    assert_matches_reference(backend, case, device=DEVICE)
    assert calls == [plan_kv_splits(2, 600, backend.num_sms, 16)[0]] and calls[0] > 1
    assert backend.kv_splits(backend.num_sms, 600) == (1, 600)


def test_kv_split_is_checked(triton_backend_cls):
    with pytest.raises(ValueError, match="kv_split"):
        triton_backend_cls(DEVICE, block_n=16, kv_split=24)
