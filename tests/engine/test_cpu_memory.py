"""glibc's malloc thresholds raised for CPU steps (runner/cpu_memory.py): a
step's large temporaries come back from the heap, not as fresh pages."""
import platform
import resource

import pytest
import torch

from minibatch_engine import Engine, build_model
from minibatch_engine.runner import cpu_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def faults_of_big_temporaries(rounds: int = 4) -> int:
    """Minor page faults of allocating, touching and freeing an 8 MB tensor, the
    last rounds (the first one may grow the heap)."""
    torch.empty(2 << 20).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        torch.empty(2 << 20).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_a_cpu_engine_keeps_freed_memory_for_the_next_step(monkeypatch):
    monkeypatch.delenv("MINIBATCH_SYSTEM_MALLOC", raising=False)
    Engine(build_model("tiny", device="cpu"), max_num_seqs=2)     # its runner raises the thresholds
    assert cpu_memory.keep_freed_memory() is True
    # 4 rounds of 2,048 fresh pages each would be 8,192 faults; the heap's pages are reused
    assert faults_of_big_temporaries() < 200


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
