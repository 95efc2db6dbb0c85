"""OpenVINO GenAI beside the engine, step by step.

    python benchmarks/openvino_steps.py [--size tiny | --model DIR] [--rounds 3] [--out benchmarks/openvino_steps_tiny.json]

Runs ``bench --vs-openvino``'s workload (64 requests, greedy, fixed lengths,
fp32, two threads, at most 64 running) through OpenVINO GenAI's
``ContinuousBatchingPipeline`` one ``step()`` at a time, timing each step and
reading how many requests it scheduled (``get_metrics().scheduled_requests``),
and through the engine, whose trace times each step and counts its sequences.
Rounds alternate the two. Steps are grouped by how many sequences ran in them;
the steps that carry prompt tokens (the first few: the engine's trace says how
many, and both systems fill the same token budget first-come, first-served)
are grouped apart. OpenVINO driven from Python pays a call per step that its
own ``generate`` loop does not; the report gives both totals, so that cost is
visible. OpenVINO runs in the engine's process here (stepping it needs its
Python object), so the engine's raised malloc thresholds
(``minibatch_engine/runner/cpu_memory.py``) apply to it too; ``bench
--vs-openvino`` runs it in a process of its own. Needs the ``openvino``
extra. Writes ``<out>`` (JSON); its figures are wall clock.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BUCKETS = ((1, 16), (17, 32), (33, 48), (49, 64))


def bucket(n: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= n <= hi:
            return f"{lo}-{hi}"
    return f">{BUCKETS[-1][1]}"


PHASES = ("schedule_s", "prepare_s", "forward_s", "sample_s", "update_s")


def summarize(steps: list[tuple], prefill_steps: int) -> dict:
    """Seconds of the prompt steps, then per bucket of sequences a step: how many
    steps, their median milliseconds and total seconds, and (for the engine) the
    median milliseconds of each phase of its steps."""
    groups: dict[str, list[tuple]] = {}
    for step in steps[prefill_steps:]:
        groups.setdefault(bucket(step[1]), []).append(step)
    out = {"steps": len(steps), "seconds": sum(st[0] for st in steps),
           "prompt_steps_seconds": sum(st[0] for st in steps[:prefill_steps]), "buckets": {}}
    for k, group in sorted(groups.items()):
        b = out["buckets"][k] = {"steps": len(group), "median_ms": statistics.median(st[0] for st in group) * 1e3,
                                 "seconds": sum(st[0] for st in group)}
        if len(group[0]) > 2:
            b["phases_median_ms"] = {ph: statistics.median(st[2][ph] for st in group) * 1e3 for ph in PHASES}
    return out


def openvino_stepwise(pipe, prompts, max_tokens, eos) -> list[tuple[float, int]]:
    from minibatch_engine.harness.vs_openvino import openvino_requests
    # a request whose handle is dropped is cancelled: keep them to the end
    handles = [pipe.add_request(i, ids, config)
               for i, (ids, config) in enumerate(openvino_requests(prompts, max_tokens, eos))]
    steps = []
    while pipe.has_non_finished_requests():
        t0 = time.perf_counter()
        pipe.step()
        dt = time.perf_counter() - t0
        steps.append((dt, pipe.get_metrics().scheduled_requests))
    produced = sum(len(out.generated_ids) for h in handles for out in h.read_all())
    if produced != sum(max_tokens):
        raise RuntimeError(f"OpenVINO's stepped run produced {produced} tokens, not {sum(max_tokens)}")
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=("tiny", "125m"), default="tiny")
    ap.add_argument("--model", default=None, help="a local Hugging Face Llama checkpoint instead of --size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from minibatch_engine.config import EngineConfig
    from minibatch_engine.harness.bench import cpu_name, warmup
    from minibatch_engine.harness.vs_openvino import (DEFAULT_CACHE, export_openvino, kv_cache_gb, make_checkpoint,
                                                      openvino_pipeline, run_openvino)
    from minibatch_engine.harness.vs_transformers import engine_for
    from minibatch_engine.harness.workload import make_workload
    from minibatch_engine.model.registry import resolve_model
    threads, batch = 2, 64
    ckpt = Path(args.model) if args.model else make_checkpoint(args.size, DEFAULT_CACHE)
    ir, _ = export_openvino(ckpt, DEFAULT_CACHE, log=lambda m: print(m, file=sys.stderr))
    torch.set_num_threads(threads)
    ours = resolve_model(str(ckpt), device="cpu", dtype="float32")
    hf_config = json.loads((ckpt / "config.json").read_text())
    specs = make_workload("uniform", 64, seed=0, vocab_size=min(256, ours.config.vocab_size))
    prompts, max_tokens = [s.prompt_token_ids for s in specs], [s.max_tokens for s in specs]
    budget = EngineConfig(max_num_seqs=batch).resolve(ours.config).max_num_batched_tokens
    cache_gb = kv_cache_gb(hf_config, prompts, max_tokens)
    pipe = openvino_pipeline(ir, batch, budget, cache_gb, threads)
    eos = hf_config.get("eos_token_id")
    warmup(ours)
    run_openvino(pipe, prompts[:2], [4, 4], eos)
    runs: dict[str, list] = {"openvino": [], "openvino_generate_s": [], "engine": []}
    prefill_steps = 0
    for r in range(args.rounds):
        order = ("openvino", "engine") if r % 2 == 0 else ("engine", "openvino")
        for name in order:
            if name == "openvino":
                t0 = time.perf_counter()
                run_openvino(pipe, prompts, max_tokens, eos)
                runs["openvino_generate_s"].append(time.perf_counter() - t0)
                runs["openvino"].append(openvino_stepwise(pipe, prompts, max_tokens, eos))
            else:
                eng, _ = engine_for(ours, prompts, max_tokens, batch, "auto", threads,
                                    kv_budget_bytes=cache_gb * 2**30, enable_prefix_caching=False)
                eng.run()
                steps = eng.trace.steps
                prefill_steps = sum(1 for s in steps if s.prefill_tokens)
                runs["engine"].append([(s.wall_dt, s.num_scheduled, {ph: getattr(s, ph) for ph in PHASES})
                                       for s in steps])
            print(f"round {r + 1}/{args.rounds} {name} done", file=sys.stderr)

    def best(name):   # the round with the least total time
        return min(runs[name], key=lambda steps: sum(st[0] for st in steps))
    summary = {
        "size": args.model or args.size, "parameters": sum(p.numel() for p in ours.parameters()), "rounds": args.rounds,
        "threads": threads, "batch": batch, "output_tokens": sum(max_tokens), "prompt_steps": prefill_steps,
        "cpu": f"{cpu_name()} ({os.cpu_count()} CPUs)", "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "openvino_generate_seconds": runs["openvino_generate_s"],
        "openvino_stepwise_seconds": [sum(st[0] for st in steps) for steps in runs["openvino"]],
        "engine_seconds": [sum(st[0] for st in steps) for steps in runs["engine"]],
        "openvino": summarize(best("openvino"), prefill_steps),
        "engine": summarize(best("engine"), prefill_steps),
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
