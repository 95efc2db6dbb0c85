"""The fused CPU ops (model/fused.py) equal their torch formulas."""
import pytest
import torch
import torch.nn.functional as F

from minibatch_engine.attention.cpu_kernel import cpu_kernel_available, load_cpu_kernel
from minibatch_engine.model import fused

needs_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler: the kernels cannot build")


def torch_rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_ops_equal_the_formulas(dtype):
    k = load_cpu_kernel()
    g = torch.Generator().manual_seed(0)
    tol = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for T in (1, 7, 300):
        x = torch.randn(T, 96, generator=g, dtype=torch.float64).to(dtype)
        w = torch.randn(96, generator=g, dtype=torch.float64).to(dtype)
        torch.testing.assert_close(k.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5), **tol)
        qkv = torch.randn(T, 7 * 16, generator=g, dtype=torch.float64).to(dtype)
        heads = qkv[:, :5 * 16].view(T, 5, 16)          # strided token rows, as the model passes them
        cos, sin = torch.randn(2, T, 16, generator=g, dtype=torch.float64).to(dtype)
        torch.testing.assert_close(k.rope(heads, cos, sin), torch_rope(heads, cos, sin), **tol)
        gu = torch.randn(T, 2 * 40, generator=g, dtype=torch.float64).to(dtype) * 4
        gate, up = gu.chunk(2, -1)
        torch.testing.assert_close(k.silu_and_mul(gu), F.silu(gate) * up, **tol)


@needs_kernel
def test_the_model_helpers_pick_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    real = fused._kernel

    def spy(x):
        k = real(x)
        calls.append(k is not None)
        return k
    monkeypatch.setattr(fused, "_kernel", spy)
    x = torch.randn(3, 8)
    fused.rms_norm(x, torch.ones(8), 1e-5)
    fused.rms_norm(x.bfloat16(), torch.ones(8).bfloat16(), 1e-5)        # half precision: torch
    fused.rms_norm(x.requires_grad_(), torch.ones(8), 1e-5)              # autograd: torch
    with fused.torch_ops_only():
        fused.rms_norm(x.detach(), torch.ones(8), 1e-5)
    fused.rms_norm(x.detach(), torch.ones(8), 1e-5)
    assert calls == [True, False, False, False, True]


def test_without_the_kernel_the_formulas_run(monkeypatch):
    monkeypatch.setattr(fused, "_kernel", lambda x: None)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 32, generator=g), torch.randn(32, generator=g)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6))
    q, cos, sin = torch.randn(4, 2, 8, generator=g), torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    torch.testing.assert_close(fused.apply_rope(q, cos, sin), torch_rope(q, cos, sin))
    gu = torch.randn(4, 10, generator=g)
    torch.testing.assert_close(fused.silu_and_mul(gu), F.silu(gu[:, :5]) * gu[:, 5:])
