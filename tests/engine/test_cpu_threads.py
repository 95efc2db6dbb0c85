"""CPU threads from the cores that are free (issue 27): a busy process beside the
engine lowers the thread count, never below one, never above PyTorch's default."""
import os
import subprocess
import sys
import time

import pytest
import torch

from minibatch_engine import Engine, EngineConfig
from minibatch_engine.runner.cpu_threads import DEFAULT_NUM_THREADS, choose_num_threads, free_cores, set_cpu_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_choose_num_threads_from_free_cores():
    assert choose_num_threads(None) == DEFAULT_NUM_THREADS           # the system does not say: the default
    assert choose_num_threads(0.0) == 1 and choose_num_threads(0.4) == 1
    assert choose_num_threads(1.6) == min(2, DEFAULT_NUM_THREADS)
    assert choose_num_threads(1000.0) == DEFAULT_NUM_THREADS          # never above the default


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_a_busy_process_takes_a_core_off_the_free_ones():
    cpus = os.cpu_count()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = free_cores(0.3)
    finally:
        hog.kill()
        hog.wait()
    assert 0 <= busy <= cpus - 0.5


def test_the_engine_sets_the_threads_it_is_given(tiny32, restore_threads):
    Engine(tiny32, max_num_seqs=2, max_model_len=32, cpu_threads=1)
    assert torch.get_num_threads() == 1
    assert set_cpu_threads("auto") in range(1, DEFAULT_NUM_THREADS + 1)


@pytest.mark.parametrize("bad", [0, -1, "many", 1.5, True])
def test_bad_cpu_threads_are_refused(bad):
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=bad)
