"""The Triton paged-attention kernel equals the reference.

On a CPU the kernel runs through Triton's interpreter: ``TRITON_INTERPRET=1``
must be set before the kernel is decorated, so this module sets it at import
(it is read only by triton, and only CPU runs need it). On CUDA the kernel is
compiled and runs on the GPU. Skipped when triton is not installed.
"""
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from minibatch_engine.attention import get_attention_backend  # noqa: E402
from minibatch_engine.attention.triton_backend import TritonBackend  # noqa: E402
from minibatch_engine.attention.triton_kernel import paged_attention_kernel  # noqa: E402

from .attention_cases import assert_matches_reference, random_batch  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"
pytestmark = pytest.mark.triton     # `make gpu-check` runs these on the GPU too (-m "cuda or triton")
if not ON_CUDA and type(paged_attention_kernel).__name__ != "InterpretedFunction":
    pytest.skip("the kernel was imported before TRITON_INTERPRET=1 was set: run this module "
                "in its own process", allow_module_level=True)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_equals_reference(kind, dtype):
    """Random block tables, block sizes 1/16/32, ragged lengths, GQA ratios 1/2/4;
    with the cache (paged reads) and without (keys from the flat batch)."""
    backend = TritonBackend(DEVICE, block_m=16, block_n=16)     # small tiles: several loop trips
    gen = torch.Generator().manual_seed(5)
    for block_size, (heads, kv_heads) in [(1, (2, 2)), (16, (4, 2)), (32, (4, 1)), (16, (3, 3))]:
        case = random_batch(gen, kind, block_size, heads, kv_heads, 16, dtype, num_seqs=3, max_len=36)
        assert_matches_reference(backend, case, device=DEVICE)
        assert_matches_reference(backend, case, cache=False, device=DEVICE)


def test_triton_head_dim_not_a_power_of_two_and_wide_tiles():
    gen = torch.Generator().manual_seed(9)
    case = random_batch(gen, "mixed", 4, 4, 2, 24, torch.float64, num_seqs=3, max_len=20)
    assert_matches_reference(TritonBackend(DEVICE, block_m=32, block_n=32), case, device=DEVICE)


def test_triton_tile_sizes_are_checked():
    with pytest.raises(ValueError, match="power of two >= 16"):
        TritonBackend(DEVICE, block_n=8)


@pytest.mark.skipif(not ON_CUDA, reason="auto picks triton only on CUDA")
def test_auto_is_triton_on_cuda():
    assert get_attention_backend("auto", "cuda").name == "triton"


@torch.no_grad()
def test_triton_in_the_model_gives_the_reference_tokens():
    """Chunked prefill and decode over a paged cache, and a cache-free forward,
    through the kernel in the whole tiny model (float64): full-recompute tokens."""
    from minibatch_engine.model import build_model, full_forward_logits, reference_generate

    from .test_attention_backends import paged_greedy

    model = build_model("tiny", device=DEVICE, dtype="float64")
    backend = TritonBackend(DEVICE, block_m=16, block_n=16)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 11, 6)]
    got = paged_greedy(model, backend, prompts, 3, block_size=4, chunk=5)
    assert got == [reference_generate(model, p, 3) for p in prompts]
    ids = torch.tensor(prompts[1], device=DEVICE)
    n = len(prompts[1])
    logits = model(ids, torch.arange(n, device=DEVICE), backend.build_metadata([n], [n], device=DEVICE),
                   None, all_logits=True)
    torch.testing.assert_close(logits, full_forward_logits(model, prompts[1]), rtol=0, atol=1e-10)
