"""The engine on a quiet machine and on a busy one, side by side.

    python benchmarks/busy_machine.py [--rounds 3] [--busy 2] [--threads 2] [--out benchmarks/busy_machine]

One process runs rounds that alternate a quiet machine and a loaded one. In a
loaded round the load arrives mid-run, as it does on a shared machine: each
system is built on the quiet machine, its timed run starts, and
``--arrive-after`` seconds later (0.5 by default) ``--busy`` other processes
start spinning (two by default, on this book's two cores). Each round times,
on the same weights and workload (the tiny Llama shape, 64 requests of the
``uniform`` workload, at most 64 running):

* the engine given ``--threads`` threads (``cpu_threads=2``), as it runs by
  default: it re-decides its threads while it runs, taking the cores other
  processes leave free (:class:`minibatch_engine.runner.cpu_threads.LoadFollower`);
* the same engine with those threads fixed (``cpu_threads_follow_load=False``,
  what it did before): its threads wait at every barrier for a core another
  process holds;
* transformers' continuous batching (``generate_batch``) at the same threads.

It writes ``<out>.json`` (every timing, the threads each run ended on, the
load average before each run, and each round's loaded / quiet ratio) and
``<out>.md`` (the table). Needs ``transformers``. Wall-clock figures: they say
what this machine did.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from minibatch_engine import Engine, SamplingParams
from minibatch_engine.harness.bench import cpu_name, warmup
from minibatch_engine.model.hf_export import save_hf_checkpoint
from minibatch_engine.model.registry import resolve_model
from minibatch_engine.harness.vs_transformers import _require_transformers, run_hf_continuous
from minibatch_engine.harness.workload import make_workload

FOLLOWS, FIXED, HF = "engine (follows the load)", "engine (threads fixed)", "transformers continuous batching"
SYSTEMS = (FOLLOWS, FIXED, HF)


def busy_process() -> subprocess.Popen:
    """Another process keeping one core busy."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=2, help="busy processes in a loaded round (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="the threads each system is given (default 2)")
    ap.add_argument("--arrive-after", type=float, default=0.5,
                    help="seconds into a loaded run when the busy processes start (default 0.5)")
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

    def engine(follow_load: bool):
        """Built now (on the quiet machine); returns the timed part."""
        eng = Engine(ours, max_num_seqs=batch, cpu_threads=args.threads, cpu_threads_follow_load=follow_load)
        for p, m in zip(prompts, max_tokens):
            eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
        return eng.run

    def hf_continuous():
        torch.set_num_threads(args.threads)
        return lambda: run_hf_continuous(hf, prompts, max_tokens, batch)

    builders = {FOLLOWS: lambda: engine(True), FIXED: lambda: engine(False), HF: hf_continuous}
    warmup(ours)
    results = {load: {name: [] for name in SYSTEMS} for load in ("quiet", "loaded")}
    threads = {load: {name: [] for name in SYSTEMS} for load in ("quiet", "loaded")}
    load_before = {load: {name: [] for name in SYSTEMS} for load in ("quiet", "loaded")}
    for r in range(args.rounds):
        for load in ("quiet", "loaded"):
            for name in SYSTEMS:
                timed = builders[name]()
                load_before[load][name].append(os.getloadavg()[0])
                hogs: list[subprocess.Popen] = []

                def arrive():                        # the load arrives mid-run
                    hogs.extend(busy_process() for _ in range(args.busy))

                timer = threading.Timer(args.arrive_after, arrive) if load == "loaded" else None
                try:
                    t0 = time.perf_counter()
                    if timer:
                        timer.start()
                    with torch.no_grad():
                        timed()
                    dt = time.perf_counter() - t0
                finally:
                    if timer:
                        timer.cancel()
                        timer.join()
                    for h in hogs:
                        h.kill()
                        h.wait()
                n = torch.get_num_threads()          # what the run ended on
                results[load][name].append(output_tokens / dt)
                threads[load][name].append(n)
                print(f"round {r + 1}/{args.rounds} {load:6s} {name:34s} ended on {n} threads "
                      f"{output_tokens / dt:8,.0f} tok/s", flush=True)
    best = {load: {name: max(v) for name, v in d.items()} for load, d in results.items()}
    summary = {
        "cpu": f"{cpu_name()} ({os.cpu_count()} CPUs)", "torch": torch.__version__,
        "transformers": transformers.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "workload": "uniform", "num_requests": args.num_requests, "batch": batch, "output_tokens": output_tokens,
        "rounds": args.rounds, "threads_given": args.threads, "busy_processes": args.busy,
        "load": f"{args.busy} other processes spinning, started {args.arrive_after} s into each run",
        "tokens_per_second": results, "threads": threads, "load_average_before": load_before,
        "best_tokens_per_second": best,
        "loaded_over_quiet_per_round": {name: [lo / q for lo, q in zip(results["loaded"][name],
                                                                         results["quiet"][name])]
                                        for name in SYSTEMS},
        "loaded_over_quiet": {name: best["loaded"][name] / best["quiet"][name] for name in SYSTEMS},
        "engine_over_transformers": {load: best[load][FOLLOWS] / best[load][HF]
                                     for load in ("quiet", "loaded")},
    }
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# The engine on a quiet and a busy machine ({summary['cpu']}, {summary['date_utc']} UTC)", "",
             f"`python benchmarks/busy_machine.py`: {args.num_requests} `uniform` requests, at most {batch} "
             f"running, tiny Llama shape, {args.threads} threads given; loaded: {summary['load']}. "
             f"Best of {args.rounds} rounds, output tokens/s (wall clock).", "",
             "| system | quiet | loaded | loaded / quiet | loaded / quiet, each round |", "|---|---|---|---|---|"]
    for name in SYSTEMS:
        each = ", ".join(f"{x:.2f}" for x in summary["loaded_over_quiet_per_round"][name])
        lines.append(f"| {name} | {best['quiet'][name]:,.0f} | {best['loaded'][name]:,.0f} | "
                     f"{summary['loaded_over_quiet'][name]:.2f} | {each} |")
    lines += ["", "Engine (follows the load) over transformers' continuous batching: "
              f"{summary['engine_over_transformers']['quiet']:.1f}x quiet, "
              f"{summary['engine_over_transformers']['loaded']:.1f}x loaded."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
