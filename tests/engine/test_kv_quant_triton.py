"""The Triton kernel over a quantized KV cache (fp8 / int8) equals the reference.

Like ``test_attention_triton.py``, on a CPU this module sets ``TRITON_INTERPRET=1``
at import, before the kernel is decorated (run it in its own process)."""
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from minibatch_engine import Engine, SamplingParams, reference_generate  # noqa: E402
from minibatch_engine.attention.triton_backend import TritonBackend  # noqa: E402
from minibatch_engine.attention.triton_kernel import paged_attention_kernel  # noqa: E402

from .attention_cases import random_batch  # noqa: E402
from .kv_quant_cases import assert_quantized_matches_reference, every_fp8_code  # noqa: E402

DEVICE = "cuda" if ON_CUDA else "cpu"
pytestmark = pytest.mark.triton
if not ON_CUDA and type(paged_attention_kernel).__name__ != "InterpretedFunction":
    pytest.skip("the kernel was imported before TRITON_INTERPRET=1 was set: run this module "
                "in its own process", allow_module_level=True)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_equals_the_reference_over_a_quantized_cache(kv, dtype):
    """Decodes, prefills and chunks; block sizes 1/16/32; GQA; scales per (token,
    head) and static: the kernel's dequantizing loads give the reference's output."""
    backend = TritonBackend(DEVICE, block_m=16, block_n=16)
    gen = torch.Generator().manual_seed(6)
    for kind in ("decode", "mixed"):
        for block_size, (h, hkv) in [(1, (2, 2)), (16, (4, 2)), (32, (4, 1))]:
            case = random_batch(gen, kind, block_size, h, hkv, 16, dtype, num_seqs=3, max_len=36)
            assert_quantized_matches_reference(backend, case, kv, device=DEVICE)
            assert_quantized_matches_reference(backend, case, kv, static=True, device=DEVICE)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_triton_in_the_engine_gives_the_quantized_lone_recompute(tiny64, kv):
    model = tiny64.to(DEVICE)
    engine = Engine(model, max_num_seqs=2, block_size=4, max_num_batched_tokens=8, kv_cache_dtype=kv,
                    attention_backend="triton", cuda_graphs=False)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True)) for p in prompts]
    engine.run()
    for r, p in zip(reqs, prompts):
        assert engine.samples_of(r.request_id)[0].output_token_ids == reference_generate(model, p, 5, kv)


def test_triton_decodes_every_fp8_code():
    ref, out = every_fp8_code(TritonBackend(DEVICE, block_m=16, block_n=16), DEVICE)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
