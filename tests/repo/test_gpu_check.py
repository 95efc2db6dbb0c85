"""What ``make gpu-check`` (tools/gpu_check.py) can be checked for without a GPU.

A GPU is lent to this project for a few minutes at a time, so the script must
not fail for reasons a CPU can find first: the measurements' schedules (run
here on the simulator, with the same scheduler and block arithmetic as on the
GPU), the Triton comparison's plumbing (through Triton's interpreter, in
float32), and the refusal without CUDA.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SIM = dict(sim_gpu="H200", sim_model="llama-3.2-1b")


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_prefill_measurement_runs_in_one_step(gpu_check):
    """All PREFILL prompts must be computed in the first step (the timed one); a
    KV watermark once held the last prompt back and the script raised."""
    eng = gpu_check.prefill_engine(None, **SIM)
    eng.run()
    n, length = gpu_check.PREFILL
    assert eng.trace.steps[0].prefill_tokens == n * length


@pytest.mark.parametrize("batch", [1, 32, 256])
def test_the_decode_measurement_has_steady_steps(gpu_check, batch):
    eng = gpu_check.decode_engine(None, batch, graphs=True, **SIM)
    eng.run()
    steps = gpu_check.steady_decode_steps(eng, batch)
    assert len(steps) >= gpu_check.DECODE_STEPS // 2
    assert all(s.decode_tokens == batch and s.prefill_tokens == 0 for s in steps)


def test_the_triton_comparison_passes_through_the_interpreter():
    pytest.importorskip("triton")
    code = ("import importlib.util, json, torch\n"
            f"spec = importlib.util.spec_from_file_location('g', {str(ROOT / 'tools' / 'gpu_check.py')!r})\n"
            "g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)\n"
            "print(json.dumps(g.triton_check(torch.float32, device='cpu')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["max_abs_error"] < 1e-4 and result["dtype"] == "float32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out",
                           str(tmp_path / "g.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "g.json").exists()
