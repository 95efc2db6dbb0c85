"""Build and load the C++ kernels for the CPU (``csrc/``): the paged-attention
kernel (``paged_attention_cpu.cpp``), the model's fused small ops (``cpu_ops.cpp``,
used by :mod:`minibatch_engine.model.fused`) and the linear layers' product over
weights packed into panels (``panel_gemm.cpp``, used by
:mod:`minibatch_engine.runner.prepack`), and a llama step's decoder layers as
one loop over those kernels (``decoder_layers.cpp``, used by
:mod:`minibatch_engine.runner.flat_forward`).

The kernels are compiled on first use with the machine's C++ compiler through
``torch.utils.cpp_extension`` (half a minute to a few minutes, once: the library
is cached under ``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``).
The build always uses the ``ninja`` installed beside this Python (the pip
package the engine depends on), not whichever one ``PATH`` finds first: two
ninja releases hash build commands differently, so switching between them (by
activating a virtual environment or not) would rebuild everything. The build
says so on stderr, wherever stderr goes (terminal, notebook cell, pipe, log),
with a line every 30 s while it runs and the time it took at the end. It is
compiled for this CPU (``-march=native``), so the cache key includes the CPU's
flags as well as the source, the flags and the torch version: a home directory
shared by different machines never loads a library built for another CPU. The
sources are copied into the build folder first, so the build does not depend on
where the package is installed either.

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
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "paged_attention_cpu.cpp", CSRC / "cpu_ops.cpp", CSRC / "panel_gemm.cpp",
           CSRC / "decoder_layers.cpp", CSRC / "bindings.cpp"]
HEADERS = [CSRC / "simd_passes.h", CSRC / "query_block.h"]     # part of the cache key: a change rebuilds
# -ffast-math is for the compile step only (vectorised exp); see the source's header.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
LDFLAGS = ["-fopenmp"]
HEARTBEAT_S = 30.0      # a "still compiling" line this often while the build runs

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
        folder = build_directory(name)
        # the guard only where a build may run or a dead one left its lock: a plain
        # load of a built library never waits on another process's load
        guard = build_guard(folder) if building or (Path(folder) / "lock").exists() else nullcontext()
        with guard:
            building = building and not _is_built(name)    # another process may have built it meanwhile
            t0 = time.perf_counter()
            with _pinned_ninja(), _build_messages(name, building or verbose):
                _module = load(name, _staged_sources(name), extra_cflags=list(CFLAGS),
                               extra_ldflags=list(LDFLAGS), verbose=verbose)
        if building or verbose:
            _say(f"C++ CPU kernels compiled in {_duration(time.perf_counter() - t0)}; cached in "
                 f"{build_directory(name)} (later runs load them at once)")
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


def _say(msg: str) -> None:
    print(f"minibatch_engine: {msg}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    """``"42 s"`` or ``"4 min 22 s"``."""
    s = round(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60} s"


@contextmanager
def _build_messages(name: str, say: bool):
    """Say that the build starts, and every :data:`HEARTBEAT_S` seconds that it
    still runs (from a thread: the build itself blocks), so that a notebook cell
    or a piped command never looks hung."""
    if not say:
        yield
        return
    _say("compiling the C++ CPU kernels (paged attention, fused ops, linear layers), once: it takes half a "
         f"minute to a few minutes; the result is cached in {build_directory(name)}")
    done = threading.Event()
    t0 = time.perf_counter()

    def beat():
        while not done.wait(HEARTBEAT_S):
            _say(f"still compiling the C++ CPU kernels ({_duration(time.perf_counter() - t0)} so far)")

    thread = threading.Thread(target=beat, name="minibatch-cpp-build", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


GUARD_FILE = "minibatch-build.flock"
# A torch lock found under the guard belongs to a dead build, or to a process that
# does not take the guard (an older release of this package): this long untouched,
# it is taken for dead.
UNGUARDED_LOCK_S = 30.0
QUIET_WAIT_S = 5.0      # waiting longer than this for the guard is said on stderr


@contextmanager
def build_guard(folder: str):
    """Hold an exclusive ``flock`` on ``folder``/:data:`GUARD_FILE` while torch
    builds or loads the kernels there.

    torch marks a build in progress with a ``lock`` file and makes every other
    process wait until the file is gone; a build that is killed (a timeout,
    Ctrl+C, an out-of-memory kill) leaves the file, and they would wait forever.
    The operating system drops an ``flock`` when its process dies, however it
    dies. So a process that holds the guard and still finds torch's ``lock``
    knows the build that left it is dead, and removes it (once it is
    :data:`UNGUARDED_LOCK_S` old, in case a process that does not take the
    guard holds it). While a live process builds, the others wait here, saying
    so on stderr. Without ``fcntl`` (Windows) the guard does nothing."""
    try:
        import fcntl
    except ImportError:      # pragma: no cover - not on POSIX
        yield
        return
    os.makedirs(folder, exist_ok=True)
    with open(Path(folder) / GUARD_FILE, "a") as f:
        deadline = time.monotonic() + QUIET_WAIT_S
        while True:                # a short wait (another process loading) says nothing
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    _say(f"waiting for another process that is compiling the C++ CPU kernels in {folder}")
                    fcntl.flock(f, fcntl.LOCK_EX)
                    break
                time.sleep(0.05)
        try:
            _remove_dead_lock(Path(folder) / "lock")
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_dead_lock(lock: Path) -> None:
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age >= UNGUARDED_LOCK_S:
            try:
                lock.unlink()
            except FileNotFoundError:
                return
            _say(f"removed a build lock in {lock.parent} that a killed build left behind")
            return
        time.sleep(0.2)


def ninja_dir() -> str | None:
    """The folder of the ``ninja`` the build uses: the pip package's (beside this
    Python), else the one beside ``sys.executable``, else the first on ``PATH``.
    It does not depend on ``PATH`` when the engine's own dependency is installed."""
    try:
        import ninja  # the pip package (a dependency of minibatch-engine)
        d = Path(ninja.BIN_DIR)
        if (d / "ninja").exists() or (d / "ninja.exe").exists():
            return str(d)
    except (ImportError, AttributeError):
        pass
    d = Path(sys.executable).parent
    if (d / "ninja").exists() or (d / "ninja.exe").exists():
        return str(d)
    found = shutil.which("ninja")
    return str(Path(found).parent) if found else None


@contextmanager
def _pinned_ninja():
    """``PATH`` with :func:`ninja_dir` first, for torch's ``ninja`` calls."""
    d = ninja_dir()
    old = os.environ.get("PATH", "")
    if d is None or old.split(os.pathsep)[:1] == [d]:
        yield
        return
    os.environ["PATH"] = d + os.pathsep + old
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _check_toolchain() -> None:
    """Raise :class:`KernelUnavailable` where the kernels cannot be built (nothing is built here)."""
    if os.environ.get("MINIBATCH_NO_CPP", "0") not in ("", "0"):
        raise KernelUnavailable("MINIBATCH_NO_CPP is set")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler ({cxx!r} is not on PATH)")
    if ninja_dir() is None:
        raise KernelUnavailable(f"ninja is not installed (pip install ninja, into {sys.prefix})")


def build_directory(name: str) -> str:
    """Where torch builds and caches extension ``name`` (``TORCH_EXTENSIONS_DIR``)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return _get_build_directory(name, verbose=False)
    except Exception:
        return os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")


def _staged_sources(name: str) -> list[str]:
    """The sources copied into the build folder (``src/``), rewritten only when
    they differ: the build's command lines name these paths, so they do not
    change with where the package lives (two checkouts, an editable install and
    a wheel share one build instead of rebuilding each other's)."""
    dst = Path(build_directory(name)) / "src"
    dst.mkdir(parents=True, exist_ok=True)
    for p in SOURCES + HEADERS:
        text = p.read_text()
        target = dst / p.name
        if not target.exists() or target.read_text() != text:
            tmp = target.with_suffix(target.suffix + f".{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, target)
    return [str(dst / p.name) for p in SOURCES]


def _is_built(name: str) -> bool:
    try:
        return (Path(build_directory(name)) / f"{name}.so").exists()
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
