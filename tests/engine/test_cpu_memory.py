"""glibc's malloc thresholds raised for CPU steps (runner/cpu_memory.py): a
step's large temporaries come back from the heap, not as fresh pages."""
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minibatch_engine import Engine, build_model
from minibatch_engine.runner import cpu_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


MB48 = 12 << 20          # floats: 48 MiB, above the 32 MiB where glibc's own mmap threshold stops adapting
PAGES = (MB48 * 4) // 4096


def faults_of_big_temporaries(rounds: int = 4) -> int:
    """Minor page faults of allocating, touching and freeing a 48 MiB tensor,
    ``rounds`` times after a first one (which may grow the heap)."""
    torch.empty(MB48).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        torch.empty(MB48).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_a_cpu_engine_keeps_freed_memory_for_the_next_step(monkeypatch):
    monkeypatch.delenv("MINIBATCH_SYSTEM_MALLOC", raising=False)
    Engine(build_model("tiny", device="cpu"), max_num_seqs=2)     # its runner raises the thresholds
    assert cpu_memory.keep_freed_memory() is True
    # with glibc's own thresholds each round maps fresh pages (4 x 12,288 faults); the heap's
    # pages are reused (at most one round's worth, should something else take the freed block,
    # plus the few pages the interpreter's own small allocations touch meanwhile: one was seen)
    assert faults_of_big_temporaries() < 2 * PAGES


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_glibcs_own_thresholds_fault_every_round():
    """The same measurement in a fresh process left to glibc: the test above can fail."""
    code = ("import sys; sys.path.insert(0, %r); import test_cpu_memory as t; "
            "print(t.faults_of_big_temporaries())" % str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "MINIBATCH_SYSTEM_MALLOC": "1"}).stdout
    assert int(out.split()[-1]) >= 3 * PAGES


def test_the_environment_wins(monkeypatch):
    for env in ({"MINIBATCH_SYSTEM_MALLOC": "1"}, {"MALLOC_TRIM_THRESHOLD_": "0"}, {"MALLOC_MMAP_THRESHOLD_": "0"}):
        monkeypatch.setattr(cpu_memory, "_kept", None)
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert cpu_memory.keep_freed_memory() is False
    monkeypatch.setattr(cpu_memory, "_kept", None)
    monkeypatch.setattr(cpu_memory.ctypes.util, "find_library", lambda name: None)   # no libc found
    assert cpu_memory.keep_freed_memory() is False
