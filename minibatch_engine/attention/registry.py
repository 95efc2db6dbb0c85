"""Choosing an attention backend by name: ``"reference"``, ``"sdpa"``, ``"cpp"``,
``"triton"`` or ``"auto"`` (see :mod:`.backend` for what each is). The one
place that knows every backend; no backend imports it.
"""
from __future__ import annotations

import importlib.util

import torch

from .backend import AttentionBackend

BACKENDS = ("auto", "cpp", "sdpa", "triton", "reference")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend called ``name`` for a model on ``device``.

    ``"auto"``: ``"triton"`` on CUDA when triton is installed; on a CPU ``"cpp"``
    when the C++ kernel builds here; otherwise ``"sdpa"``.
    """
    dev = torch.device(device)
    if name == "auto":
        if dev.type == "cuda" and triton_available():
            name = "triton"
        elif dev.type == "cpu":
            from .cpp_backend import CppBackend
            from .cpu_kernel import KernelUnavailable, cpu_kernel_available
            if cpu_kernel_available():
                try:
                    return CppBackend()            # builds the kernel the first time
                except KernelUnavailable:          # the build failed (said once on stderr)
                    pass
            name = "sdpa"
        else:
            name = "sdpa"
    if name == "reference":
        from .reference import REFERENCE
        return REFERENCE
    if name == "sdpa":
        from .sdpa import SdpaBackend
        return SdpaBackend()
    if name == "cpp":
        if dev.type != "cpu":
            raise ValueError(f'attention backend "cpp" runs on the CPU, not {dev.type}; use "auto"')
        from .cpu_kernel import KernelUnavailable
        from .cpp_backend import CppBackend
        try:
            return CppBackend()
        except KernelUnavailable as e:
            raise ValueError(f'attention backend "cpp" is unavailable here: {e} (pick "sdpa" or "auto")') from None
    if name == "triton":
        if not triton_available():
            raise ValueError('attention backend "triton" needs the triton package: '
                             'pip install -e ".[triton]" (or pick "sdpa" / "auto")')
        from .triton_backend import TritonBackend
        return TritonBackend(dev)
    raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")
