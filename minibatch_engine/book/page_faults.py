"""The CPU appendix's page-fault measurement ("Pages from the kernel").

:func:`prompt_steps` runs the benchmark workload's prompt steps (the tiny
model, 64 requests, batch 64, two threads) in a fresh Python process, with
glibc's malloc as the engine sets it (:mod:`minibatch_engine.runner.cpu_memory`)
or as glibc sets it alone (``MINIBATCH_SYSTEM_MALLOC=1``), and returns each
prompt step's minor page faults and seconds. A process of its own, because the
thresholds cannot be put back once raised. ``python -m
minibatch_engine.book.page_faults`` is that process (glibc's own settings with
``MINIBATCH_SYSTEM_MALLOC=1``): it prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _measure(engines: int) -> dict:
    import torch

    from ..harness.bench import warmup
    from ..harness.vs_transformers import engine_for
    from ..harness.workload import make_workload
    from ..model.registry import build_model
    from ..runner.cpu_memory import keep_freed_memory
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu", dtype="float32", seed=0)
    specs = make_workload("uniform", 64, seed=0, vocab_size=256)
    prompts, max_tokens = [s.prompt_token_ids for s in specs], [s.max_tokens for s in specs]
    warmup(model)
    runs = []
    for _ in range(engines):
        eng, _ = engine_for(model, prompts, max_tokens, 64, "auto", 2)
        steps = []
        while not eng.trace.steps or eng.trace.steps[-1].prefill_tokens:   # until the first decode-only step
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            eng.step()
            steps.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, time.perf_counter() - t0,
                          eng.trace.steps[-1].prefill_tokens))
        runs.append(steps[:-1])
    return {"kept": keep_freed_memory(), "runs": runs}


def prompt_steps(system_malloc: bool, engines: int = 4, timeout: float = 600) -> dict:
    """``{"kept": bool, "runs": [[(faults, seconds, prompt tokens) per prompt
    step] per engine]}`` from a fresh process (the first engine warms the
    heap: compare the later ones)."""
    env = {k: v for k, v in os.environ.items() if k != "MINIBATCH_SYSTEM_MALLOC"}
    if system_malloc:
        env["MINIBATCH_SYSTEM_MALLOC"] = "1"
    out = subprocess.run([sys.executable, "-m", __name__, "--engines", str(engines)], env=env, check=True,
                         capture_output=True, text=True, timeout=timeout).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=4)
    print(json.dumps(_measure(ap.parse_args().engines)))
