"""The C++ paged-attention kernel for the CPU (``attention/csrc``): what the
shared backend tests in test_attention_backends.py do not reach."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from minibatch_engine.attention import get_attention_backend
from minibatch_engine.attention import cpu_kernel
from minibatch_engine.attention.cpu_kernel import KernelUnavailable, cpu_kernel_available

from .attention_cases import assert_matches_reference, random_batch

needs_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler: the cpp kernel cannot build")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_long_contexts_many_tiles_and_big_blocks(dtype):
    """Contexts of several key tiles (32 positions each), GQA 4, and block sizes
    up to a reserved row's 256 slots, against the reference."""
    backend = get_attention_backend("cpp")
    gen = torch.Generator().manual_seed(5)
    for block_size in (7, 64, 256):
        case = random_batch(gen, "mixed", block_size, 8, 2, 32, dtype, num_seqs=5, max_len=300)
        assert_matches_reference(backend, case)


CHECKPOINT_HEAD_SIZES = [32, 64, 80, 96, 128]     # Llama and GPT-2 checkpoints' head sizes


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head_dim", CHECKPOINT_HEAD_SIZES)
def test_simd_path_matches_the_reference(dtype, head_dim):
    """Every checkpoint head size in float32/float64 takes the kernel's
    explicit-SIMD passes (a few heads per pass, their rows in registers), or
    with simd=False the plain loops. Head counts that leave a remainder pass (6
    heads: passes of 4 or 2, then single heads), GQA 1/2/3, blocks of 1/16/32,
    decodes and prefill chunks, contexts of several tiles."""
    from minibatch_engine.attention.cpp_backend import CppBackend
    assert cpu_kernel.load_cpu_kernel().simd_path(dtype, head_dim)
    gen = torch.Generator().manual_seed(11)
    for backend in (CppBackend(), CppBackend(simd=False)):     # the passes, then the plain loops
        for num_heads, num_kv_heads in ((6, 6), (6, 3), (6, 2), (4, 2)):
            for block_size in (1, 16, 32):
                case = random_batch(gen, "mixed", block_size, num_heads, num_kv_heads, head_dim, dtype,
                                    num_seqs=4, max_len=100)
                assert_matches_reference(backend, case)
        assert_matches_reference(backend, case, cache=False)


def _prompt_in_chunks(kernel, chunks, head_dim, others=0, simd=True, seed=3):
    """A float32 prompt of sum(chunks) tokens (Hq 4, Hkv 2) attended chunk by chunk
    through a paged pool of 16-slot blocks, each chunk in a step beside ``others``
    decode rows of other sequences; returns the prompt's output rows."""
    gen = torch.Generator().manual_seed(seed)
    L, bs, Hq, Hkv = sum(chunks), 16, 4, 2
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = rand(L, Hq, head_dim), rand(L, Hkv, head_dim), rand(L, Hkv, head_dim)
    blocks = -(-L // bs) + 8 * others
    perm = torch.randperm(blocks + 2, generator=gen)
    k_cache, v_cache = rand(len(perm) * bs, Hkv, head_dim), rand(len(perm) * bs, Hkv, head_dim)
    table = perm[:-(-L // bs)]
    other_tables = perm[-(-L // bs):blocks].view(max(others, 1), -1)[:others] if others else None
    outs, done = [], 0
    for n in chunks:
        rows = slice(done, done + n)
        slots = table[torch.arange(done, done + n) // bs] * bs + torch.arange(done, done + n) % bs
        width = max(len(table), other_tables.shape[1] if others else 0)
        tables = [torch.nn.functional.pad(table, (0, width - len(table)))]
        qs, ks, vs, sl, lens = [q[rows]], [k[rows]], [v[rows]], [slots], [done + n]
        for o in range(others):     # a decode row with context 100 + 7 o beside the chunk
            ctx = 100 + 7 * o
            tables.append(torch.nn.functional.pad(other_tables[o], (0, width - other_tables.shape[1])))
            qs.append(rand(1, Hq, head_dim)), ks.append(rand(1, Hkv, head_dim)), vs.append(rand(1, Hkv, head_dim))
            sl.append(other_tables[o][(ctx - 1) // bs].view(1) * bs + (ctx - 1) % bs), lens.append(ctx)
        query_start = torch.tensor([0, n] + [n + o + 1 for o in range(others)])
        out = kernel.paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache,
                                     torch.cat(sl).long(), torch.stack(tables).long().contiguous(),
                                     torch.tensor(lens), query_start, bs, simd)
        outs.append(out[:n])
        done += n
    return torch.cat(outs)


@needs_kernel
@pytest.mark.parametrize("head_dim", CHECKPOINT_HEAD_SIZES)
def test_prompt_query_blocks_do_not_depend_on_the_chunking(head_dim):
    """float32 prompts take the query-block path (query_block.h: up to a vector's
    width of queries at once, one head): a query's output is bit for bit the same
    whatever chunks split the prompt and whatever decode rows share the step, and
    agrees with the per-token plain loops to float32 rounding."""
    kernel = cpu_kernel.load_cpu_kernel()
    whole = _prompt_in_chunks(kernel, [77], head_dim)
    for chunks, others in (([5, 16, 3, 30, 23], 0), ([40, 37], 3), ([2] * 38 + [1], 2)):
        got = _prompt_in_chunks(kernel, chunks, head_dim, others)
        if chunks[-1] == 1:    # a lone new token is a decode row: the per-token walk, other rounding
            assert torch.equal(got[:-1], whole[:-1])
            torch.testing.assert_close(got[-1:], whole[-1:], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, whole), chunks
    plain = _prompt_in_chunks(kernel, [77], head_dim, simd=False)
    torch.testing.assert_close(whole, plain, rtol=1e-5, atol=1e-5)
    assert not torch.equal(whole, plain)     # really another path: the summation order differs


@needs_kernel
def test_threads_take_the_work_items_in_any_order_with_the_same_result():
    """The threads take work items from a shared counter (costliest sequences
    first), so which thread computes an item changes from call to call: every item
    writes only its own rows, so the output is bit for bit the same on 1, 2 and 3
    threads."""
    from .attention_cases import run_backend
    backend = get_attention_backend("cpp")
    gen = torch.Generator().manual_seed(11)
    case = random_batch(gen, "mixed", 16, 8, 2, 64, torch.float32, num_seqs=9, max_len=300)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 2):
            torch.set_num_threads(threads)
            outs.append(run_backend(backend, case)[0])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert_matches_reference(backend, case)


@needs_kernel
@pytest.mark.parametrize("head_dim", CHECKPOINT_HEAD_SIZES)
def test_bfloat16_caches_take_the_simd_passes_too(head_dim):
    """A bfloat16 cache is read as float32 vectors in the SIMD passes: close to
    the float64 reference, and to the plain loops (the same float32 arithmetic,
    summed in another order, each rounded to bfloat16)."""
    from minibatch_engine.attention.cpp_backend import CppBackend
    from .attention_cases import reference, run_backend
    kernel = cpu_kernel.load_cpu_kernel()
    assert kernel.simd_path(torch.bfloat16, head_dim) and not kernel.simd_path(torch.float16, head_dim)
    gen = torch.Generator().manual_seed(3)
    for num_heads, num_kv_heads, block_size in ((6, 2, 16), (4, 4, 1)):
        case64 = random_batch(gen, "mixed", block_size, num_heads, num_kv_heads, head_dim, torch.float64,
                              num_seqs=4, max_len=100)
        case = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in case64.items()}
        simd, _, _ = run_backend(CppBackend(), case)
        plain, _, _ = run_backend(CppBackend(simd=False), case)
        ref, _, _ = reference(case64)
        torch.testing.assert_close(simd.double(), ref, rtol=0, atol=5e-2)
        torch.testing.assert_close(simd.double(), plain.double(), rtol=0, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64])
def test_half_precision_runs_and_is_close(head_dim):
    backend = get_attention_backend("cpp")
    gen = torch.Generator().manual_seed(2)
    case64 = random_batch(gen, "mixed", 16, 4, 2, head_dim, torch.float64, num_seqs=4)
    case = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) else v for k, v in case64.items()}
    from .attention_cases import reference, run_backend
    out, _, _ = run_backend(backend, case)
    ref, _, _ = reference(case64)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-2)


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64])     # the plain loops and the SIMD passes
def test_strided_token_rows_are_read_in_place(head_dim):
    """q, k and v as views into one fused projection (rows strided, as the model
    passes them) give the same output as contiguous copies."""
    backend = get_attention_backend("cpp")
    gen = torch.Generator().manual_seed(9)
    D = head_dim
    case = random_batch(gen, "mixed", 4, 4, 2, D, torch.float32, num_seqs=5)
    fused = torch.cat([case["q"].flatten(1), case["k"].flatten(1), case["v"].flatten(1)], dim=1)
    q, k, v = fused.split([4 * D, 2 * D, 2 * D], dim=1)
    strided = dict(case, q=q.view(-1, 4, D), k=k.view(-1, 2, D), v=v.view(-1, 2, D))
    assert not strided["q"].is_contiguous()
    assert_matches_reference(backend, strided)
    assert_matches_reference(backend, strided, cache=False)


@needs_kernel
def test_kernel_rejects_bad_inputs():
    kernel = cpu_kernel.load_cpu_kernel()
    q, k = torch.zeros(3, 4, 8), torch.zeros(3, 2, 8)
    e = torch.empty(0, dtype=torch.long)
    sl, qs = torch.tensor([3]), torch.tensor([0, 3])
    with pytest.raises(RuntimeError, match="head mismatch"):
        kernel.paged_attention(q, torch.zeros(3, 3, 8), torch.zeros(3, 3, 8), e, e, e, e, sl, qs, 1, True)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel.paged_attention(q, k.double(), k.double(), e, e, e, e, sl, qs, 1, True)
    with pytest.raises(RuntimeError, match="int64"):
        kernel.paged_attention(q, k, k, e, e, e, e, sl.int(), qs, 1, True)
    cache = torch.zeros(8, 2, 8)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        kernel.paged_attention(q, k, k, cache, cache, torch.tensor([0, 1]), torch.tensor([[0]]), sl, qs, 4, True)
    with pytest.raises(ValueError, match='runs on the CPU'):
        get_attention_backend("cpp", "cuda")


@needs_kernel
def test_loading_the_kernel_keeps_denormals():
    """The kernel is compiled with -ffast-math; linking the fast-math runtime
    would switch the whole process to flush-to-zero. It must not."""
    code = ("import torch; from minibatch_engine.attention.cpu_kernel import load_cpu_kernel; "
            "load_cpu_kernel(); x = torch.tensor([1e-40]); print(float(x * 1.0) != 0.0, float(x.double() / 4) != 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_auto_falls_back_to_sdpa_without_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_module", None)
    monkeypatch.setattr(cpu_kernel, "_error", "no C++ compiler (test)")
    assert not cpu_kernel_available()
    assert get_attention_backend("auto", "cpu").name == "sdpa"
    with pytest.raises(ValueError, match='"cpp" is unavailable here: no C\\+\\+ compiler'):
        get_attention_backend("cpp", "cpu")


def test_a_missing_compiler_is_reported(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "_module", None)
    monkeypatch.setattr(cpu_kernel, "_error", None)
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler"):
        cpu_kernel.load_cpu_kernel()
    monkeypatch.setattr(cpu_kernel, "_error", None)


def test_the_build_cache_key_follows_source_flags_and_cpu(monkeypatch):
    name = cpu_kernel.extension_name()
    assert name.startswith("minibatch_paged_attention_")
    monkeypatch.setattr(cpu_kernel, "CFLAGS", cpu_kernel.CFLAGS + ["-DX"])
    assert cpu_kernel.extension_name() != name
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernel, "_cpu_signature", lambda: "another cpu")
    assert cpu_kernel.extension_name() != name


@needs_kernel
@pytest.mark.parametrize("what, match", [
    ("slot", "outside the pool's"), ("block", "outside the pool's"), ("table", "needs 2 blocks"),
    ("query_start", "query_start"), ("context", "tokens of context"),
])
def test_indices_outside_the_pool_are_refused_before_any_work(what, match):
    """A wrong slot or block id used to read or write outside the pool's memory."""
    kernel = cpu_kernel.load_cpu_kernel()
    T, H, D, bs, blocks = 3, 2, 16, 4, 5
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    k_cache, v_cache = torch.zeros(blocks * bs, H, D), torch.zeros(blocks * bs, H, D)
    slots = torch.tensor([4, 5, 6])
    table = torch.tensor([[0, 1]])
    seq_lens, qstart = torch.tensor([7]), torch.tensor([0, 3])
    args = dict(slot=slots, table=table, seq_lens=seq_lens, qstart=qstart)
    kernel.paged_attention(q, k, v, k_cache, v_cache, slots, table, seq_lens, qstart, bs, True)   # fine
    if what == "slot":
        args["slot"] = torch.tensor([4, 5, blocks * bs])
    elif what == "block":
        args["table"] = torch.tensor([[0, blocks]])
    elif what == "table":
        args["table"] = torch.tensor([[0]])
    elif what == "query_start":
        args["qstart"] = torch.tensor([0, 2])
    else:
        args["seq_lens"] = torch.tensor([2])
    with pytest.raises(RuntimeError, match=match):
        kernel.paged_attention(q, k, v, k_cache, v_cache, args["slot"], args["table"], args["seq_lens"],
                               args["qstart"], bs, True)


def test_asking_whether_the_kernel_is_available_builds_nothing(monkeypatch):
    """cpu_kernel_available() used to compile the kernels (minutes) as a side effect."""
    monkeypatch.setattr(cpu_kernel, "_module", None)
    monkeypatch.setattr(cpu_kernel, "_error", None)
    import torch.utils.cpp_extension as ext

    def no_build(*a, **kw):
        raise AssertionError("a build was started")
    monkeypatch.setattr(ext, "load", no_build)
    assert cpu_kernel_available() == (shutil.which(os.environ.get("CXX", "c++")) is not None)
