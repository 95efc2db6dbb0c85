"""Random ragged attention batches over a paged pool, shared by the backend tests."""
import torch

from minibatch_engine.attention import get_attention_backend


def random_batch(gen: torch.Generator, kind: str, block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, num_seqs: int = 5, max_len: int = 40):
    """``kind``: "decode" (one new token each), "prefill" (several new tokens each,
    some after cached context: chunks), "mixed" (both). Block tables are random
    pool blocks (sometimes one spare block at the end); the pool starts full of
    noise, so a backend that reads a slot it should not gets a wrong answer."""
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    query_lens, seq_lens = [], []
    for s in range(num_seqs):
        k = kind if kind != "mixed" else ("decode", "prefill")[s % 2]
        if k == "decode":
            n = r(1, max_len)
            query_lens.append(1), seq_lens.append(n)
        else:
            n = r(2, max_len)
            query_lens.append(n if r(0, 1) else r(2, n)), seq_lens.append(n)
    need = [-(-n // block_size) + r(0, 1) for n in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    T = sum(query_lens)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = rand(T, num_heads, head_dim), rand(T, num_kv_heads, head_dim), rand(T, num_kv_heads, head_dim)
    k_cache = rand(num_blocks * block_size, num_kv_heads, head_dim)
    v_cache = rand(num_blocks * block_size, num_kv_heads, head_dim)
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, query_lens=query_lens,
                seq_lens=seq_lens, block_tables=tables, block_size=block_size)


def run_backend(backend, case, cache=True, device="cpu"):
    """The backend's output and the caches after its write, on a copy of ``case``."""
    c = {key: val.to(device) if isinstance(val, torch.Tensor) else val for key, val in case.items()}
    if not cache:
        ql = c["query_lens"]
        meta = backend.build_metadata(ql, ql, device=device)
        return backend.forward(c["q"], c["k"], c["v"], meta), None, None
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    meta = backend.build_metadata(c["query_lens"], c["seq_lens"], c["block_tables"], c["block_size"], device)
    return backend.forward(c["q"], c["k"], c["v"], meta, kc, vc), kc, vc


def reference(case, cache=True):
    return run_backend(get_attention_backend("reference"), case, cache)


def assert_matches_reference(backend, case, cache=True, device="cpu"):
    out, kc, vc = run_backend(backend, case, cache, device)
    ref, rkc, rvc = reference(case, cache)
    tol = dict(rtol=0, atol=1e-12) if case["q"].dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu(), ref, **tol)
    if cache:
        assert torch.equal(kc.cpu(), rkc) and torch.equal(vc.cpu(), rvc)


__all__ = ["random_batch", "run_backend", "reference", "assert_matches_reference"]
