"""The engine on a quiet machine and on a busy one, side by side.

    python benchmarks/busy_machine.py [--rounds 3] [--out benchmarks/busy_machine]

One process runs rounds that alternate a quiet machine and a loaded one (one
other process spinning on a core, as a browser tab or a second notebook
would), and in each it times, on the same weights and workload (the tiny Llama
shape, 64 requests of the ``uniform`` workload, at most 64 running):

* the engine as configured by default (``cpu_threads="auto"``: the cores that
  are free when it starts, :mod:`minibatch_engine.runner.cpu_threads`);
* the engine with PyTorch's default threads, one per core (what it did before
  ``cpu_threads``);
* transformers' continuous batching (``generate_batch``), as a user runs it
  (PyTorch's default threads).

It writes ``<out>.json`` (every timing) and ``<out>.md`` (the table). Needs
``transformers``. Wall-clock figures: they say what this machine did.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minibatch_engine.harness.bench import cpu_name, warmup
from minibatch_engine.runner.cpu_threads import DEFAULT_NUM_THREADS
from minibatch_engine.model.hf_export import save_hf_checkpoint
from minibatch_engine.model.registry import resolve_model
from minibatch_engine.harness.vs_transformers import _require_transformers, engine_for, run_hf_continuous
from minibatch_engine.harness.workload import make_workload

SYSTEMS = ("engine (auto threads)", "engine (one thread per core)", "transformers continuous batching")


def busy_process() -> subprocess.Popen:
    """Another process keeping one core busy."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("busy_machine"))
    args = ap.parse_args(argv)
    transformers = _require_transformers()
    ours = resolve_model("tiny", device="cpu", dtype="float32")
    with tempfile.TemporaryDirectory() as ckpt:
        save_hf_checkpoint(ours, ckpt)
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    specs = make_workload("uniform", args.num_requests, seed=0)
    prompts, max_tokens = [s.prompt_token_ids for s in specs], [s.max_tokens for s in specs]
    output_tokens = sum(max_tokens)
    batch = 64

    def engine(threads):
        eng, _ = engine_for(ours, prompts, max_tokens, batch, "auto", cpu_threads=threads)
        chosen = torch.get_num_threads()
        eng.run()
        return chosen

    def hf_continuous():
        torch.set_num_threads(DEFAULT_NUM_THREADS)
        run_hf_continuous(hf, prompts, max_tokens, batch)
        return DEFAULT_NUM_THREADS

    runs = {SYSTEMS[0]: lambda: engine("auto"), SYSTEMS[1]: lambda: engine(DEFAULT_NUM_THREADS),
            SYSTEMS[2]: hf_continuous}
    warmup(ours)
    results = {load: {name: [] for name in SYSTEMS} for load in ("quiet", "loaded")}
    threads = {load: {name: [] for name in SYSTEMS} for load in ("quiet", "loaded")}
    for r in range(args.rounds):
        for load in ("quiet", "loaded"):
            hog = busy_process() if load == "loaded" else None
            try:
                if hog:
                    time.sleep(1.0)              # let it take its core
                for name in SYSTEMS:
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        n = runs[name]()
                    dt = time.perf_counter() - t0
                    results[load][name].append(output_tokens / dt)
                    threads[load][name].append(n)
                    print(f"round {r + 1}/{args.rounds} {load:6s} {name:34s} {n} threads "
                          f"{output_tokens / dt:8,.0f} tok/s", flush=True)
            finally:
                if hog:
                    hog.kill()
                    hog.wait()
    best = {load: {name: max(v) for name, v in d.items()} for load, d in results.items()}
    summary = {
        "cpu": f"{cpu_name()} ({os.cpu_count()} CPUs)", "torch": torch.__version__,
        "transformers": transformers.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "workload": "uniform", "num_requests": args.num_requests, "batch": batch, "output_tokens": output_tokens,
        "rounds": args.rounds, "load": "one other process spinning on one core",
        "tokens_per_second": results, "threads": threads, "best_tokens_per_second": best,
        "loaded_over_quiet": {name: best["loaded"][name] / best["quiet"][name] for name in SYSTEMS},
        "engine_over_transformers": {load: best[load][SYSTEMS[0]] / best[load][SYSTEMS[2]]
                                     for load in ("quiet", "loaded")},
    }
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# The engine on a quiet and a busy machine ({summary['cpu']}, {summary['date_utc']} UTC)", "",
             f"`python benchmarks/busy_machine.py`: {args.num_requests} `uniform` requests, at most {batch} "
             f"running, tiny Llama shape; loaded: {summary['load']}. Best of {args.rounds} rounds, "
             "output tokens/s (wall clock).", "",
             "| system | quiet | loaded | loaded / quiet |", "|---|---|---|---|"]
    for name in SYSTEMS:
        lines.append(f"| {name} | {best['quiet'][name]:,.0f} | {best['loaded'][name]:,.0f} | "
                     f"{summary['loaded_over_quiet'][name]:.2f} |")
    lines += ["", "Engine (auto threads) over transformers' continuous batching: "
              f"{summary['engine_over_transformers']['quiet']:.1f}x quiet, "
              f"{summary['engine_over_transformers']['loaded']:.1f}x loaded."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
