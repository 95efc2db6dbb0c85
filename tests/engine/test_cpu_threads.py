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


def test_a_number_is_a_ceiling_and_quiet_keeps_it():
    cpus = os.cpu_count()
    assert choose_num_threads(cpus - 0.2, ceiling=7) == 7          # quiet: the number given, even above cores
    assert choose_num_threads(0.0, ceiling=7) == 1
    assert choose_num_threads(1.6, ceiling=1) == 1
    if cpus >= 4:
        assert choose_num_threads(1.6, ceiling=7) == 2              # busy: the free cores


def test_the_follower_gives_cores_back_and_takes_them_again(monkeypatch, restore_threads):
    """Samples made up by hand: 2 CPUs, 100 jiffies a second, this process idle.
    Threads go down at the first look that finds the cores taken, and come back
    only when two looks in a row find them free."""
    from minibatch_engine.runner import cpu_threads
    monkeypatch.setattr(cpu_threads.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    state = {"busy": 0, "total": 0}

    def sample():
        return (state["busy"], state["total"]), 0.0

    monkeypatch.setattr(cpu_threads, "_sample", sample)

    def second(others_busy_cores):          # one second of the machine: 200 jiffies on 2 CPUs
        state["busy"] += int(100 * others_busy_cores)
        state["total"] += 200

    torch.set_num_threads(2)
    follower = cpu_threads.LoadFollower(ceiling=2, interval_s=0.0)
    second(0.1)
    assert follower.poll() == 2 and follower.changes == 0        # quiet: nothing changes
    second(1.4)
    assert follower.poll() == 1 and torch.get_num_threads() == 1  # load arrived: one free core
    second(1.0)
    assert follower.poll() == 1
    second(0.0)
    assert follower.poll() == 1                                   # it left: one look is not enough
    second(1.4)
    assert follower.poll() == 1                                   # it came back: still one
    second(0.0)
    assert follower.poll() == 1
    second(0.0)
    assert follower.poll() == 2 and follower.changes == 2         # two quiet looks in a row: both cores
    follower.interval_s = 3600.0
    second(2.0)
    assert follower.poll() == 2                                   # between looks: no file read, no change


def test_fixed_threads_stay_as_given(tiny32, restore_threads):
    eng = Engine(tiny32, max_num_seqs=2, max_model_len=32, cpu_threads=2, cpu_threads_follow_load=False)
    assert torch.get_num_threads() == 2 and eng.runner.load_follower is None
    with pytest.raises(ValueError, match="cpu_threads_follow_load"):
        EngineConfig(cpu_threads_follow_load="yes")


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_load_that_arrives_mid_run_lowers_the_threads_and_keeps_the_tokens(tiny32, restore_threads):
    """Busy processes start after the engine's first steps: within a few looks the
    engine runs on fewer threads than it was given, and its greedy tokens are the
    ones a one-thread run gives."""
    from minibatch_engine import SamplingParams
    prompts = [list(range(1 + i, 9 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    low = {}

    def run(eng, hogs_after=None):
        reqs = [eng.add_request(p, params) for p in prompts]
        hogs, steps = [], 0
        try:
            while eng.has_unfinished():
                if steps == hogs_after:      # more busy processes than cores
                    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                            for _ in range(os.cpu_count() + 2)]
                    deadline = time.monotonic() + 20
                    while torch.get_num_threads() == 2 and time.monotonic() < deadline:
                        time.sleep(0.05)
                        eng.runner.load_follower.poll()
                    low["threads"] = torch.get_num_threads()
                eng.step()
                steps += 1
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        return [list(r.output_token_ids) for r in reqs]

    want = run(Engine(tiny32, max_num_seqs=4, max_model_len=32, cpu_threads=1, cpu_threads_follow_load=False))
    eng = Engine(tiny32, max_num_seqs=4, max_model_len=32, cpu_threads=2)
    got = run(eng, hogs_after=3)
    assert low["threads"] == 1
    assert got == want
