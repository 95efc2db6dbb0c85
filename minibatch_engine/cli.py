"""``python -m minibatch_engine {generate,bench,simulate,sweep}`` (also ``minibatch-engine``).

Every user error (a bad option value, a missing checkpoint, an impossible
configuration) prints ``error: ...`` and exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from .attention import BACKENDS
from .kv.config import KV_LAYOUTS
from .scheduler.config import SCHEDULER_NAMES
from .scheduler.policy import POLICIES
from .scheduler.preemption import PREEMPTION_MODES
from .model.config import PRESETS
from .sim import GPUS
from .speculative.config import SPEC_METHODS
from .workload import CLASS_WORKLOADS, DEFAULT_SLO_E2E_S, DEFAULT_SLO_TTFT_S, parse_clients, workload_names

FORMATTER = argparse.ArgumentDefaultsHelpFormatter


class Parser(argparse.ArgumentParser):
    """argparse, with the CLI's one error contract: one line ``error: ...`` and status 2."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def _checked(convert, test, what: str):
    """An argparse ``type=``: ``convert`` the text, then refuse a value failing ``test``."""
    def parse(text):
        try:
            value = convert(text)
        except (TypeError, ValueError) as e:
            detail = "" if convert in (int, float) else f" ({e})"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}{detail}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    parse.__name__ = what           # argparse names the type in some messages
    return parse


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
seed_int = _checked(int, lambda v: 0 <= v < 2**64, "a seed: an integer in [0, 2**64)")
positive_float = _checked(float, lambda v: _finite(v) and v > 0, "a finite number > 0")
non_negative_float = _checked(float, lambda v: _finite(v) and v >= 0, "a finite number >= 0")


def _cpu_threads(value: str):
    return value if value == "auto" else positive_int(value)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention-backend", choices=BACKENDS, default="auto",
                   help="auto: triton on CUDA when installed; on a CPU cpp (a C++ paged kernel, compiled on first use) when a compiler is present, else sdpa")
    p.add_argument("--model", default="tiny",
                   help="'tiny' (built-in, seeded random weights), 'tiny-py' (small, trained on Python source) or a Hugging Face checkpoint directory")
    p.add_argument("--device", default="auto", help="'auto' (CUDA when present), 'cpu' or 'cuda'")
    p.add_argument("--dtype", default="float32", help="float32, float16, bfloat16 or float64")
    p.add_argument("--cpu-threads", type=_cpu_threads, default="auto",
                   help="on a CPU: PyTorch's threads; auto (default): the cores other processes leave free")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _metric_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--percentiles", default="50,90,99", metavar="P,P,...",
                   help="latency percentiles to report (vLLM's --metric-percentiles)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, vLLM's syntax: ttft:MS tpot:MS e2el:MS")


def _bench_args(p: argparse.ArgumentParser, simulate: bool, sweep: bool = False) -> None:
    p.add_argument("--scheduler", choices=SCHEDULER_NAMES, default="continuous",
                   help="static (padded batches) or continuous (iteration-level)")
    p.add_argument("--workload", choices=workload_names(), default="uniform",
                   help="prompt/output length distribution; mixed-classes: an interactive class (short, "
                        "priority 0) and a batch class (long, priority 1)")
    p.add_argument("--num-requests", type=positive_int, default=64, help="requests in the workload")
    p.add_argument("--max-batch", type=int, default=256, help="most sequences per step (max_num_seqs)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: min(model max_position, 1024))")
    p.add_argument("--seed", type=seed_int, default=0, help="workload seed")
    if not sweep:
        p.add_argument("--arrival-rate", type=positive_float, default=None,
                       help="Poisson arrivals in requests/s (default: all at time 0)")
    p.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="with --arrival-rate: gamma-distributed gaps of this shape (1 = Poisson, smaller = burstier)")
    gpus = [g.name for g in GPUS.values()]
    p.add_argument("--sim-gpu", choices=gpus, default="H100-SXM" if simulate else None,
                   help="time every step with the simulator's cost model of this GPU (operators as measured)")
    p.add_argument("--sim-model", choices=sorted(PRESETS), default="llama-3-8b" if simulate else None,
                   help="model shape the simulator prices")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="simulator only: tensor parallelism over N GPUs (weights, KV heads, projections sharded)")
    p.add_argument("--kv", choices=KV_LAYOUTS, default=None,
                   help="KV cache layout (default: paged; reserved with --scheduler static)")
    p.add_argument("--kv-budget", type=int, default=None, metavar="BYTES",
                   help="KV cache memory in bytes (default: max-batch x max-model-len tokens, capped by memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (paged)")
    p.add_argument("--no-prefix-caching", action="store_true", help="paged: do not share prompt prefixes")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="T",
                   help="per-step token budget (default: 2048, continuous scheduler only)")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="wait until a prompt fits the budget whole instead of chunking it")
    p.add_argument("--preemption", choices=PREEMPTION_MODES, default="recompute",
                   help="how to take KV memory back when the paged cache is full")
    p.add_argument("--swap-space", type=non_negative_int, default=0, metavar="BYTES",
                   help="host memory for swapped-out KV blocks (with --preemption swap)")
    p.add_argument("--policy", choices=POLICIES, default="fcfs",
                   help="who is admitted and preempted: first come first served, priority (with "
                        "preemption), fair (VTC between clients)")
    p.add_argument("--priority-aging-s", type=positive_float, default=None, metavar="S",
                   help="priority policy: a request gains one priority level per S seconds in the system")
    p.add_argument("--clients", type=_checked(parse_clients, lambda v: True, "NAME:RATE,... (e.g. a:8,b:1)"),
                   default=None, metavar="NAME:RATE,...",
                   help="multi-tenant workload: a Poisson stream per client, e.g. a:8,b:1,c:1 "
                        "(requests/s; replaces --arrival-rate)")
    for flag, what, field, default in (("--slo-ttft-ms", "TTFT", "slo_ttft_s", DEFAULT_SLO_TTFT_S),
                                       ("--slo-e2e-ms", "end-to-end", "slo_e2e_s", DEFAULT_SLO_E2E_S)):
        classes = "; ".join(f"{c.name} {getattr(c, field) * 1e3:g}" for c in CLASS_WORKLOADS["mixed-classes"])
        p.add_argument(flag, type=positive_float, default=None, metavar="MS",
                       help=f"{what} target of every request; when not given, each class's own "
                            f"({classes}; tenants {default * 1e3:g})")
    p.add_argument("--speculative-method", choices=SPEC_METHODS, default=None,
                   help="speculative decoding: n-gram prompt lookup or a draft model (default: off)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=3, metavar="K",
                   help="tokens proposed per decoding request and step")
    if simulate:
        p.add_argument("--sim-acceptance-rate", type=float, default=0.7, metavar="A",
                       help="modelled chance that each proposed token is accepted")
    else:
        p.add_argument("--draft-model", default="tiny",
                       help="draft model for --speculative-method draft_model ('tiny' or a checkpoint directory)")
    _metric_args(p)
    if sweep:
        p.add_argument("--rates", required=True, metavar="R,R,...", help="request rates to run (requests/s)")
        p.add_argument("--jsonl", metavar="PATH", default="sweep.jsonl", help="one JSON row per rate")
        p.add_argument("--plot", metavar="PATH", help="save throughput-latency and goodput figures")
    else:
        p.add_argument("--json", metavar="PATH", help="write every summary key as JSON")
        p.add_argument("--plot", metavar="PATH", help="save a timeline figure of the run")
    if not simulate and not sweep:
        p.add_argument("--vs-transformers", action="store_true",
                       help="run the workload through transformers' generate, transformers' continuous "
                            "batching and this engine (same weights, alternating rounds) and compare")
        p.add_argument("--rounds", type=positive_int, default=3, help="with --vs-transformers: alternating rounds")
        p.add_argument("--threads", type=positive_int, default=2, help="with --vs-transformers: torch CPU threads")
    if simulate:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    else:
        _model_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="minibatch-engine", formatter_class=FORMATTER,
                                     description="minibatch-engine: generate, benchmark, simulate")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", formatter_class=FORMATTER, help="generate text from prompts",
                       description="Generate from text prompts. The built-in 'tiny' model has seeded random "
                                   "weights: its text is noise, identical on every machine.")
    g.add_argument("prompts", nargs="+", help="one or more text prompts")
    g.add_argument("--max-tokens", type=positive_int, default=32, help="most tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    g.add_argument("--seed", type=seed_int, default=None, help="sampling seed (per request)")
    g.add_argument("--scheduler", choices=SCHEDULER_NAMES, default="continuous",
                   help="static (padded batches) or continuous (iteration-level)")
    _model_args(g)

    _bench_args(sub.add_parser("bench", formatter_class=FORMATTER,
                               help="run a workload on the real model and report"), False)
    _bench_args(sub.add_parser("simulate", formatter_class=FORMATTER,
                               help="run a workload on the simulated GPU only (no model)"), True)
    sw = sub.add_parser("sweep", formatter_class=FORMATTER, help="run one configuration over request rates",
                        description="One configuration under a list of request rates: one JSON row per rate. "
                                    "With --sim-gpu the simulator alone; without, the real model on the wall "
                                    "clock through AsyncLLM (an open-loop client).")
    _bench_args(sw, False, sweep=True)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:            # --help (0) or a usage error (2, one line printed)
        return e.code
    try:
        _check_output_paths(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "sweep":
            return _sweep(args)
        return _bench(args, simulate=args.command == "simulate")
    except (ValueError, TypeError, KeyError, OSError, NotImplementedError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        if isinstance(e, OSError) and e.filename is not None:      # e.g. --json naming a directory
            msg = f"{e.strerror}: {e.filename}"
        print(f"error: {msg}", file=sys.stderr)
        return 2


def _check_output_paths(args) -> None:
    """Refuse an output file that cannot be written before the run, not after it."""
    for flag in ("json", "jsonl", "plot"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise ValueError(f"--{flag} {path}: is a directory; name a file")
        if not os.path.isdir(parent):
            raise ValueError(f"--{flag} {path}: the folder {parent} does not exist")


def _generate(args) -> int:
    from .llm import LLM
    from .sampling import SamplingParams
    llm = LLM(args.model, device=args.device, dtype=args.dtype, scheduler=args.scheduler,
              max_num_seqs=max(1, len(args.prompts)), attention_backend=args.attention_backend,
              cpu_threads=args.cpu_threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.model == "tiny":
        print("note: 'tiny' has seeded random weights, so its text is noise (the same on every machine)",
              file=sys.stderr)
    for out in llm.generate(args.prompts, params, use_tqdm=not args.no_progress):
        print(f"[{out.request_id}] {out.prompt!r} -> {out.text!r}  "
              f"({len(out.token_ids)} tokens, finished: {out.finish_reason})")
    return 0


def _engine_options(args) -> dict:
    """The EngineConfig fields the bench-like commands share."""
    return dict(kv_layout=args.kv or "auto", kv_budget_bytes=args.kv_budget, block_size=args.block_size,
                tensor_parallel_size=args.tp,
                enable_prefix_caching=not args.no_prefix_caching,
                max_num_batched_tokens="auto" if args.max_num_batched_tokens is None else args.max_num_batched_tokens,
                enable_chunked_prefill=not args.no_chunked_prefill,
                preemption_mode=args.preemption, swap_space_bytes=args.swap_space,
                policy=args.policy, priority_aging_s=args.priority_aging_s)


def _sweep(args) -> int:
    from .metrics import parse_goodput, parse_percentiles
    from .sweep import parse_rates, sweep
    simulate = args.sim_gpu is not None
    if simulate != (args.sim_model is not None):
        raise ValueError("the simulator needs both --sim-gpu and --sim-model (or neither: the real model)")
    rates, ps, slo = parse_rates(args.rates), parse_percentiles(args.percentiles), parse_goodput(args.goodput)
    opts = dict(scheduler=args.scheduler, workload=args.workload, num_requests=args.num_requests,
                max_batch=args.max_batch, seed=args.seed, burstiness=args.burstiness, percentiles=ps,
                goodput=slo, max_model_len=args.max_model_len, **_engine_options(args))
    if simulate:
        opts.update(sim_gpu=args.sim_gpu, sim_model=args.sim_model)
    else:
        opts.update(attention_backend=args.attention_backend, cpu_threads=args.cpu_threads)
    rows = sweep(rates, simulate=simulate, model=args.model, device=args.device, dtype=args.dtype,
                 jsonl=args.jsonl, progress=not args.no_progress, **opts)
    p = f"{ps[-1]:g}"
    # offered rate, then what came out: request and token throughput, latency, goodput (units in the header)
    print(f"{'rate req/s':>10} {'done req/s':>10} {'out tok/s':>9} {'TTFT p' + p + ' ms':>14} "
          f"{'TPOT p' + p + ' ms':>14}" + (f" {'goodput req/s':>13}" if slo else ""))
    for r in rows:
        print(f"{r['rate']:>10.3g} {r['request_throughput']:>10.3g} {r['output_throughput']:>9,.0f} "
              f"{r[f'ttft_ms_p{p}']:>14,.1f} {r[f'tpot_ms_p{p}']:>14,.1f}"
              + (f" {r['goodput']:>13.3g}" if slo else ""))
    print(f"rows: {args.jsonl} ({rows[0]['clock']} clock)")
    if args.plot:
        from .book import plotting
        fig = plotting.load_curves({args.scheduler: rows}, slo_ms=slo, stat=f"p{p}")
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0


def _bench(args, simulate: bool) -> int:
    from .bench import format_report, run_bench, write_json
    if not simulate and args.vs_transformers:
        return _vs_transformers(args)
    summary, engine = run_bench(
        scheduler=args.scheduler, workload=args.workload, num_requests=args.num_requests,
        max_batch=args.max_batch, seed=args.seed, sim_gpu=args.sim_gpu, sim_model=args.sim_model,
        max_model_len=args.max_model_len, arrival_rate=args.arrival_rate,
        burstiness=args.burstiness,
        progress=not args.no_progress, simulate_only=simulate,
        percentiles=args.percentiles, goodput=args.goodput,
        **_engine_options(args), clients=args.clients,
        slo_ttft_ms=args.slo_ttft_ms, slo_e2e_ms=args.slo_e2e_ms,
        speculative_method=args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
        **({"sim_acceptance_rate": args.sim_acceptance_rate} if simulate else {"draft_model": args.draft_model}),
        **({} if simulate else {"model": args.model, "device": args.device, "dtype": args.dtype,
                                "attention_backend": args.attention_backend, "cpu_threads": args.cpu_threads}))
    print(format_report(summary, simulated=simulate))
    if args.json:
        write_json(summary, args.json)
    if args.plot:
        from .book import plotting
        fig = plotting.timeline(engine.trace, title=f"{args.scheduler} on {args.workload}")
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0


def _vs_transformers(args) -> int:
    from .bench import write_json
    from .vs_transformers import compare, format_comparison, stored_difference
    if args.device not in ("auto", "cpu") or args.dtype != "float32":
        raise ValueError("--vs-transformers runs on the CPU in float32: drop --device/--dtype")
    backend = args.attention_backend
    try:
        summary = compare(args.model, num_requests=args.num_requests, batch=min(args.max_batch, args.num_requests),
                          seed=args.seed, rounds=args.rounds, threads=args.threads, attention_backend=backend,
                          workload=args.workload, log=(lambda *a: None) if args.no_progress else
                          (lambda m: print(m, file=sys.stderr)))
    except ImportError as e:
        raise ValueError(str(e)) from None
    print(format_comparison(summary))
    note = stored_difference(summary)
    if note:
        print(note)
    if args.json:
        write_json(summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
