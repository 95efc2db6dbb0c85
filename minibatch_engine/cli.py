"""``python -m minibatch_engine {generate,bench,simulate}``."""
from __future__ import annotations

import argparse
import sys

from .model.config import PRESETS
from .scheduler import SCHEDULERS
from .sim import GPUS
from .workload import WORKLOADS


def _bench_args(p: argparse.ArgumentParser, simulate: bool) -> None:
    p.add_argument("--scheduler", choices=sorted(SCHEDULERS), default="static")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="uniform")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=16, help="max requests per batch (max_num_seqs)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arrival-rate", type=float, default=None, help="Poisson arrivals, requests/s")
    gpus = [g.name for g in GPUS.values()]
    p.add_argument("--sim-gpu", choices=gpus, default="H100-SXM" if simulate else None)
    p.add_argument("--sim-model", choices=sorted(PRESETS), default="llama-3-8b" if simulate else None)
    p.add_argument("--kv", choices=["slot", "paged"], default="slot", help="KV cache layout")
    p.add_argument("--kv-budget", type=int, default=None, metavar="BYTES",
                   help="KV cache memory in bytes (default: max-batch x max-model-len tokens)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (paged)")
    p.add_argument("--no-prefix-caching", action="store_true", help="paged: do not share prefixes")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="T",
                   help="per-step token budget (continuous scheduler; default: unlimited)")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="with a budget, wait until a prompt fits whole instead of chunking it")
    p.add_argument("--preemption", choices=["recompute", "swap"], default="recompute",
                   help="how to take KV memory back when the paged cache is full")
    p.add_argument("--swap-space", type=int, default=0, metavar="BYTES",
                   help="host memory for swapped-out KV blocks (with --preemption swap)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--plot", metavar="PATH", help="save a timeline figure of the run")
    p.add_argument("--no-progress", action="store_true")
    if not simulate:
        p.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face checkpoint directory")
        p.add_argument("--device", default="auto")
        p.add_argument("--dtype", default="float32")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minibatch_engine",
                                     description="minibatch-engine: generate, benchmark, simulate")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from prompts")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--model", default="tiny")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--scheduler", choices=sorted(SCHEDULERS), default="static")
    g.add_argument("--device", default="auto")
    g.add_argument("--dtype", default="float32")

    _bench_args(sub.add_parser("bench", help="run a workload on the real model and report"), False)
    _bench_args(sub.add_parser("simulate", help="run a workload on the simulated GPU only"), True)

    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        return _bench(args, simulate=args.command == "simulate")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from .llm import LLM
    from .sampling import SamplingParams
    llm = LLM(args.model, device=args.device, dtype=args.dtype, scheduler=args.scheduler,
              max_num_seqs=max(1, len(args.prompts)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    for out in llm.generate(args.prompts, params):
        print(f"[{out.request_id}] {out.prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0


def _bench(args, simulate: bool) -> int:
    from .bench import format_table, run_bench, write_json
    summary, engine = run_bench(
        scheduler=args.scheduler, workload=args.workload, num_requests=args.num_requests,
        max_batch=args.max_batch, seed=args.seed, sim_gpu=args.sim_gpu, sim_model=args.sim_model,
        max_model_len=args.max_model_len, arrival_rate=args.arrival_rate,
        progress=not args.no_progress, simulate_only=simulate, kv_cache=args.kv,
        kv_budget_bytes=args.kv_budget, block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        preemption_mode=args.preemption, swap_space_bytes=args.swap_space,
        **({} if simulate else {"model": args.model, "device": args.device, "dtype": args.dtype}))
    print(format_table(summary))
    if args.json:
        write_json(summary, args.json)
    if args.plot:
        from . import plotting
        fig = plotting.timeline(engine.trace, title=f"{args.scheduler} on {args.workload}")
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
