"""The C++ kernels' build: one ninja whatever PATH says, a message with the real
time wherever stderr goes, and no rebuild on a second load (issue 29)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from minibatch_engine.attention import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]


def test_ninja_and_cache_key_do_not_depend_on_path(monkeypatch):
    pinned, name = cpu_kernel.ninja_dir(), cpu_kernel.extension_name()
    if pinned is None:
        pytest.skip("no ninja here")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cpu_kernel.extension_name() == name
    if Path(sys.executable).parent.joinpath("ninja").exists():
        # the venv's ninja is found even when the venv is not activated
        assert cpu_kernel.ninja_dir() == pinned


def test_pinned_ninja_puts_its_folder_first_and_restores_path(monkeypatch):
    d = cpu_kernel.ninja_dir()
    if d is None:
        pytest.skip("no ninja here")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with cpu_kernel._pinned_ninja():
        assert os.environ["PATH"].split(os.pathsep)[0] == d
    assert os.environ["PATH"] == "/usr/bin:/bin"


def test_build_messages_say_start_progress_and_nothing_when_cached(monkeypatch, capsys):
    monkeypatch.setattr(cpu_kernel, "HEARTBEAT_S", 0.05)
    with cpu_kernel._build_messages("x", True):
        time.sleep(0.2)
    err = capsys.readouterr().err
    assert "compiling the C++ CPU kernels" in err
    assert "still compiling the C++ CPU kernels" in err
    with cpu_kernel._build_messages("x", False):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""
    assert cpu_kernel._duration(42.4) == "42 s"
    assert cpu_kernel._duration(262) == "4 min 22 s"


LOAD = ("from minibatch_engine.attention.cpu_kernel import load_cpu_kernel, extension_name, "
        "build_directory; load_cpu_kernel(); print(build_directory(extension_name()))")


@pytest.mark.slow
def test_second_load_from_another_path_and_checkout_does_not_rebuild(tmp_path):
    """Load once in the environment's own cache (building it if this is the first
    load anywhere: the suite needs it anyway, and a build of its own would cost CI
    minutes), then again with the system's bin folders first on PATH (an
    unactivated venv) and from a copy of the package elsewhere (another
    checkout): nothing is compiled the second time."""
    if not cpu_kernel.cpu_kernel_available():
        pytest.skip("the C++ kernels cannot be built here")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                           env=env, timeout=1800)
    assert first.returncode == 0, first.stderr
    if "compiling the C++ CPU kernels" in first.stderr:         # this load built them
        assert "C++ CPU kernels compiled in" in first.stderr, first.stderr
    so = next(Path(first.stdout.strip()).glob("*.so"))
    mtime = so.stat().st_mtime_ns
    other = tmp_path / "checkout"
    shutil.copytree(ROOT / "minibatch_engine", other / "minibatch_engine",
                    ignore=shutil.ignore_patterns("weights", "__pycache__"))
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", PYTHONPATH=str(other))
    second = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                            env=env, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "compiling" not in second.stderr, second.stderr
    assert so.stat().st_mtime_ns == mtime


def test_a_dead_builds_lock_is_removed_and_a_live_build_waited_for(tmp_path, capsys, monkeypatch):
    """torch's ``lock`` file left by a killed build would make every later load
    wait forever. The guard's flock dies with its process: a lock found while
    holding the guard is a dead build's and is removed at once; while a live
    process holds the guard, a second one waits for it."""
    (tmp_path / "lock").touch()                       # a build killed before it could finish
    old = time.time() - 2 * cpu_kernel.UNGUARDED_LOCK_S
    os.utime(tmp_path / "lock", (old, old))
    with cpu_kernel.build_guard(str(tmp_path)):
        assert not (tmp_path / "lock").exists()
    assert "killed build" in capsys.readouterr().err

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from minibatch_engine.attention import cpu_kernel
        with cpu_kernel.build_guard({str(tmp_path)!r}):
            open({str(tmp_path / "lock")!r}, "w").close()     # torch's lock of a live build
            print("holding", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        entered = threading.Event()

        def second():
            with cpu_kernel.build_guard(str(tmp_path)):
                entered.set()
        waiter = threading.Thread(target=second, daemon=True)
        waiter.start()
        assert not entered.wait(1.0)                  # the live build's lock is kept, and waited for
        assert (tmp_path / "lock").exists()
        monkeypatch.setattr(cpu_kernel, "UNGUARDED_LOCK_S", 0.0)
        holder.kill()                                 # the builder dies mid-build
        assert entered.wait(120)
        waiter.join(10)
        assert not (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()