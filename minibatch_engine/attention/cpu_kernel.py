"""Build and load the C++ kernels for the CPU (``csrc/``): the paged-attention
kernel (``paged_attention_cpu.cpp``) and the model's fused small ops (``cpu_ops.cpp``,
used by :mod:`minibatch_engine.model.fused`).

The kernels are compiled on first use with the machine's C++ compiler through
``torch.utils.cpp_extension`` (about half a minute, once: the library is cached
under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). It is
compiled for this CPU (``-march=native``), so the cache key includes the CPU's
flags as well as the source, the flags and the torch version: a home directory
shared by different machines never loads a library built for another CPU.

:func:`load_cpu_kernel` returns the module (building it when needed, and saying
so on stderr with the time it took), or raises :class:`KernelUnavailable`
saying why (no compiler, a failed build). :func:`cpu_kernel_available` only
looks (built already, or buildable here); it never starts a build.
``MINIBATCH_NO_CPP=1`` turns the kernel off (``"auto"`` then picks ``"sdpa"``).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "paged_attention_cpu.cpp", CSRC / "cpu_ops.cpp", CSRC / "bindings.cpp"]
HEADERS = [CSRC / "simd_passes.h"]     # part of the cache key: a change rebuilds
# -ffast-math is for the compile step only (vectorised exp); see the source's header.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
LDFLAGS = ["-fopenmp"]

_module = None
_error: str | None = None


class KernelUnavailable(RuntimeError):
    """The C++ kernel cannot be built or loaded here (the message says why)."""


def _cpu_signature() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + platform.processor() + flags


def extension_name() -> str:
    """``minibatch_paged_attention_<hash>``: source, flags, torch, Python and CPU in the hash."""
    key = "\n".join([*(p.read_text() for p in SOURCES + HEADERS), " ".join(CFLAGS + LDFLAGS), torch.__version__,
                     sys.version, _cpu_signature()])
    return "minibatch_paged_attention_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def load_cpu_kernel(verbose: bool = False):
    """The compiled kernel module (built on first call, then cached in memory and on disk)."""
    global _module, _error
    if _module is not None:
        return _module
    if _error is not None:
        raise KernelUnavailable(_error)
    try:
        _check_toolchain()
        from torch.utils.cpp_extension import load
        name = extension_name()
        building = not _is_built(name)
        if building or verbose:      # said wherever stderr goes: a terminal, a notebook cell, a log
            print("minibatch_engine: compiling the C++ CPU kernels (paged attention, fused ops) once; "
                  "it takes about half a minute to a few minutes, and is cached afterwards...",
                  file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        _module = load(name, [str(p) for p in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=verbose)
        if building or verbose:
            print(f"minibatch_engine: C++ CPU kernels compiled in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        return _module
    except KernelUnavailable as e:
        _error = str(e)
    except Exception as e:   # a failed build or load: remember why, fall back elsewhere
        last = (str(e).strip().splitlines() or [""])[-1]
        _error = f"building the C++ kernels failed: {type(e).__name__}: {last}"
    if "MINIBATCH_NO_CPP" not in _error:   # said once per process
        print(f"minibatch_engine: no C++ CPU kernels ({_error}); using torch operators "
              "(sdpa attention): slower, same results", file=sys.stderr, flush=True)
    raise KernelUnavailable(_error)


def _check_toolchain() -> None:
    """Raise :class:`KernelUnavailable` where the kernels cannot be built (nothing is built here)."""
    if os.environ.get("MINIBATCH_NO_CPP", "0") not in ("", "0"):
        raise KernelUnavailable("MINIBATCH_NO_CPP is set")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler ({cxx!r} is not on PATH)")
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        raise KernelUnavailable("ninja is not installed (pip install ninja)")


def _is_built(name: str) -> bool:
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:
        return False


def cpu_kernel_or_none():
    """The compiled module, or None where it cannot be built (builds it if needed;
    after the first call this is a lookup)."""
    if _module is not None:
        return _module
    try:
        return load_cpu_kernel()
    except KernelUnavailable:
        return None


def cpu_kernel_available() -> bool:
    """True when the kernel is loaded, or can be built here (a compiler and
    ninja, not switched off, no failed build yet). It never builds: the first
    :func:`load_cpu_kernel` does."""
    if _module is not None:
        return True
    if _error is not None:
        return False
    try:
        _check_toolchain()
    except KernelUnavailable:
        return False
    return True
