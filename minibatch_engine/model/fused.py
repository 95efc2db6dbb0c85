"""The model's small ops, fused into one C++ kernel each on a CPU.

A decode step runs each layer's RMSNorm, rotary embedding and SwiGLU activation
on a few dozen rows. Written in torch they are 6, 5 and 2 computing ops, each a dispatch
and a pass over memory; at that size the dispatches cost more than the
arithmetic. On a CPU where the C++ kernels build (``attention/csrc/cpu_ops.cpp``,
built with the paged-attention kernel) each becomes one call; elsewhere
(CUDA, no compiler, autograd, half precision, ``MINIBATCH_NO_CPP=1``) the torch
formula below it runs. Both compute the same formula; they differ only in float
rounding (tests/test_fused_ops.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..attention.cpu_kernel import cpu_kernel_or_none

_FUSED_DTYPES = (torch.float32, torch.float64)
_enabled = True


@contextmanager
def torch_ops_only():
    """Run the torch formulas inside the block, even where the kernels exist (to
    measure what fusing buys, or to count the operators a GPU would launch)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _kernel(x: torch.Tensor):
    """The compiled module when ``x`` can use it, else None."""
    if not _enabled or x.device.type != "cpu" or x.dtype not in _FUSED_DTYPES or \
            (torch.is_grad_enabled() and x.requires_grad):
        return None
    return cpu_kernel_or_none()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dim (half precision in
    float32, float64 in float64)."""
    k = _kernel(x)
    if k is not None and weight.dtype == x.dtype and not (torch.is_grad_enabled() and weight.requires_grad):
        return k.rms_norm(x, weight, eps)
    xf = x if x.dtype == torch.float64 else x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-rotation layout (as in HF Llama). x: [T, H, D]; cos, sin: [T, D]."""
    k = _kernel(x)
    if k is not None and x.stride(-1) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return k.rope(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: ``silu(gate) * up`` for ``gate_up = [gate | up]``."""
    k = _kernel(gate_up)
    if k is not None and gate_up.stride(-1) == 1:
        return k.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
