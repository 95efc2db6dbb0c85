"""``python -m minibatch_engine {generate,bench,simulate,sweep,plan,serve,route}`` (also ``minibatch-engine``).

Every user error (a bad option value, a missing checkpoint, an impossible
configuration) prints ``error: ...`` and exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager

from ..attention import BACKENDS
from ..kv.config import KV_LAYOUTS
from ..kv.quant import KV_CACHE_DTYPES
from ..scheduler.config import SCHEDULER_NAMES
from ..scheduler.policy import POLICIES
from ..scheduler.preemption import PREEMPTION_MODES
from ..model.config import PRESETS
from ..sim import GPUS
from ..model.quantization import QUANTIZATION_METHODS
from ..sim.precision import WEIGHT_DTYPES
from ..speculative.config import SPEC_METHODS
from ..harness.request_traces import TRACE_FILES
from ..harness.workload import CLASS_WORKLOADS, DEFAULT_SLO_E2E_S, DEFAULT_SLO_TTFT_S, parse_clients, workload_names

class FORMATTER(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, unless the help already says what the default is."""

    def _get_help_string(self, action):
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


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
    p.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=None,
                   help="quantize the model's projections through torchao: int8 (int8 weights and "
                        "activations) or int8_weight_only (default: none, the --dtype weights)")
    p.add_argument("--cpu-threads", type=_cpu_threads, default="auto",
                   help="on a CPU: PyTorch's threads; auto (default): the cores other processes leave free; "
                        "a number N: N, or fewer while other processes hold cores (re-decided four times a second)")
    p.add_argument("--cpu-threads-fixed", action="store_true",
                   help="keep --cpu-threads as given, whatever other processes do (to time kernels)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _metric_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--percentiles", default="50,90,99", metavar="P,P,...",
                   help="latency percentiles to report (vLLM's --metric-percentiles)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, vLLM's syntax: ttft:MS tpot:MS e2el:MS")


def _bench_args(p: argparse.ArgumentParser, simulate: bool, sweep: bool = False, serve: bool = False) -> None:
    """The options of bench, simulate and sweep; ``serve``: the engine options alone."""
    p.add_argument("--scheduler", choices=SCHEDULER_NAMES, default="continuous",
                   help="static (padded batches) or continuous (iteration-level)")
    p.add_argument("--max-batch", type=positive_int, default=256, help="most sequences per step (max_num_seqs)")
    p.add_argument("--max-model-len", type=_checked(int, lambda v: v >= 2, "an integer >= 2"), default=None,
                   help="longest prompt + output (default: min(model max_position, 1024); the simulator "
                        "replaying a trace: the simulated model's max_position)")
    if serve:
        _engine_args(p, simulate)
        _model_args(p)
        return
    if not simulate:
        p.add_argument("--endpoint", metavar="URL", default=None,
                       help="measure this OpenAI-compatible server instead (e.g. http://127.0.0.1:8000: "
                            "minibatch-engine serve, vLLM, SGLang): the same workload, streamed over HTTP, "
                            "on the wall clock; the engine options are then the server's business")
        p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                       help="with --endpoint: the bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--workload", choices=workload_names() + list(TRACE_FILES), default=None,
                   help="prompt/output length distribution (default: uniform); mixed-classes: an interactive "
                        "class (short, priority 0) and a batch class (long, priority 1); azure-conv, "
                        "azure-code: Azure's production traces of 2023 replayed (see --trace)")
    p.add_argument("--num-requests", type=positive_int, default=None,
                   help="requests in the workload (default: 64; with a trace, every request of the window, "
                        "and N keeps the window's first N)")
    p.add_argument("--seed", type=seed_int, default=0, help="workload seed")
    if not sweep:
        p.add_argument("--arrival-rate", type=positive_float, default=None,
                       help="Poisson arrivals in requests/s (default: all at time 0)")
    p.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="with --arrival-rate: gamma-distributed gaps of this shape (1 = Poisson, smaller = burstier)")
    _trace_args(p, sweep)
    _sim_args(p, simulate)
    _engine_args(p, simulate)
    _workload_tail(p, simulate, sweep)


def _trace_args(p: argparse.ArgumentParser, sweep: bool) -> None:
    """Replaying a request trace (harness/request_traces.py): which one, which window, how fast."""
    g = p.add_argument_group("trace replay (--workload azure-conv|azure-code, or --trace PATH)")
    g.add_argument("--trace", metavar="PATH", default=None,
                   help="replay this CSV (columns arrived_at,num_prefill_tokens,num_decode_tokens: seconds, "
                        "prompt tokens, output tokens): its arrivals, lengths and order exactly; prompts are "
                        "seeded random token ids, outputs exactly the given length (EOS ignored)")
    g.add_argument("--trace-start", type=non_negative_float, default=0.0, metavar="S",
                   help="keep the requests that arrived from S trace seconds on, re-based so S is 0 s")
    g.add_argument("--trace-duration", type=positive_float, default=None, metavar="S",
                   help="keep the requests that arrived in [start, start + S) trace seconds (default: to the end)")
    g.add_argument("--time-scale", type=positive_float, default=None, metavar="X",
                   help="arrivals X times faster (every gap divided by X): the replay's rate is the trace's "
                        "rate times X (default: 1)" + ("; a sweep sets it from --rates instead" if sweep else ""))
    g.add_argument("--trace-clip", action="store_true",
                   help="shorten requests longer than --max-model-len (the prompt first, then the output) "
                        "instead of refusing the trace; the simulator's default --max-model-len with a trace "
                        "is the simulated model's whole context")


def _sim_args(p: argparse.ArgumentParser, simulate: bool) -> None:
    gpus = [g.name for g in GPUS.values()]
    p.add_argument("--sim-gpu", choices=gpus, default="H100-SXM" if simulate else None,
                   help="time every step with the simulator's cost model of this GPU (operators as measured)")
    p.add_argument("--sim-model", choices=sorted(PRESETS), default="llama-3-8b" if simulate else None,
                   help="model shape the simulator prices")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="simulator only: tensor parallelism over N GPUs (weights, KV heads, projections sharded)")
    p.add_argument("--pp", type=positive_int, default=1, metavar="N",
                   help="simulator only: pipeline parallelism over N stages of layers, each on --tp GPUs (8 GPUs "
                        "to a node); micro-batches kept in flight as vLLM's virtual engines, hand-overs priced "
                        "from the measured send/recv")
    p.add_argument("--ep", type=positive_int, default=1, metavar="N",
                   help="simulator only, a mixture-of-experts --sim-model: expert parallelism over N GPUs "
                        "(experts split, attention data-parallel, two all-to-alls per MoE layer; --tp 1)")
    p.add_argument("--expert-imbalance", type=float, default=1.0, metavar="X",
                   help="simulator only, with --ep: the busiest GPU's routed tokens over the mean (1 = uniform)")
    p.add_argument("--weight-dtype", choices=list(WEIGHT_DTYPES), default="auto",
                   help="simulator only: the projection weights' dtype it prices (auto = bf16; fp8; int4 with "
                        "a scale and zero per 128 weights): fewer bytes read per decode step, more memory "
                        "for KV. Priced by bytes alone: the GPU profiles hold bf16 GEMMs only, so no "
                        "fp8/int4 kernel, fp8 tensor-core speed-up or dequantization cost is in it")


def _engine_args(p: argparse.ArgumentParser, simulate: bool) -> None:
    """KV cache, token budget, preemption, policy, speculative decoding."""
    p.add_argument("--kv", choices=KV_LAYOUTS, default=None,
                   help="KV cache layout (default: paged; reserved with --scheduler static)")
    p.add_argument("--kv-budget", type=positive_int, default=None, metavar="BYTES",
                   help="KV cache memory in bytes (default: max-batch x max-model-len tokens, capped by memory)")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (paged)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="how K and V are stored: auto (the model's dtype), fp8 (float8 e4m3) or int8, "
                        "one byte per value plus a float32 scale per token and KV head")
    p.add_argument("--no-prefix-caching", action="store_true", help="paged: do not share prompt prefixes")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="T",
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


def _workload_tail(p: argparse.ArgumentParser, simulate: bool, sweep: bool) -> None:
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
    _metric_args(p)
    if sweep:
        p.add_argument("--rates", required=True, metavar="R,R,...",
                       help="request rates to run (requests/s); with a trace, each rate replays the window "
                            "with the time scale that brings its mean rate there (scale = R / trace rate)")
        p.add_argument("--jsonl", metavar="PATH", default="sweep.jsonl", help="one JSON row per rate")
        p.add_argument("--plot", metavar="PATH", help="save throughput-latency and goodput figures")
    else:
        p.add_argument("--json", metavar="PATH", help="write every summary key as JSON")
        p.add_argument("--plot", metavar="PATH", help="save a timeline figure of the run")
    if not simulate and not sweep:
        p.add_argument("--vs-transformers", action="store_true",
                       help="run the workload through transformers' generate, transformers' continuous "
                            "batching and this engine (same weights, alternating rounds) and compare")
        p.add_argument("--vs-openvino", action="store_true",
                       help="run the workload through OpenVINO GenAI's ContinuousBatchingPipeline and this "
                            "engine (the same checkpoint, exported once to OpenVINO IR; fp32; alternating "
                            "rounds) and compare throughput and tokens (needs the extra: "
                            "pip install 'minibatch-engine[openvino]')")
        p.add_argument("--size", choices=("tiny", "125m"), default=None,
                       help="with --vs-openvino: instead of --model, a seeded random Llama it creates "
                            "(tiny: the built-in 3M model; 125m: hidden 768, 12 layers, 12/4 heads, vocab 32000)")
        p.add_argument("--also", metavar="SYSTEMS", default="",
                       help="with --vs-openvino: more CPU engines in the same rounds, comma-separated: "
                            "transformers, ctranslate2, llama.cpp (each skipped, saying why, when not installed)")
        p.add_argument("--openvino-cache", metavar="DIR", default=None,
                       help="with --vs-openvino: where created checkpoints and exported IR are kept "
                            "(default ~/.cache/minibatch-engine/openvino)")
        p.add_argument("--rounds", type=positive_int, default=3,
                       help="with --vs-transformers or --vs-openvino: alternating rounds")
        p.add_argument("--threads", type=positive_int, default=2,
                       help="with --vs-transformers or --vs-openvino: CPU threads of every system")
    if simulate:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        _cluster_args(p)
    else:
        _model_args(p)


def _cluster_args(p: argparse.ArgumentParser) -> None:
    from ..cluster.link import LINKS
    from ..cluster.replicas import PREFIX_SOURCES
    from ..cluster.router import ROUTER_POLICIES
    g = p.add_argument_group("many engines (chapter 12)")
    g.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="N co-located engine replicas behind a router (default: one engine, no router)")
    g.add_argument("--router", choices=list(ROUTER_POLICIES), default=None,
                   help="how the router picks a replica (default: round-robin; with disaggregation, "
                        "least-requests for the prefill pool)")
    g.add_argument("--max-imbalance", type=non_negative_int, default=8, metavar="R",
                   help="--router prefix: consider only replicas with at most R more requests "
                        "outstanding than the least busy (the load guard)")
    g.add_argument("--prefix-source", choices=PREFIX_SOURCES, default="router",
                   help="--router prefix: the router's own record of what it sent where, or the "
                        "replicas' caches themselves")
    g.add_argument("--prefill-replicas", type=positive_int, default=None, metavar="P",
                   help="disaggregated: P prefill replicas (with --decode-replicas)")
    g.add_argument("--decode-replicas", type=positive_int, default=None, metavar="D",
                   help="disaggregated: D decode replicas (with --prefill-replicas)")
    g.add_argument("--link", choices=list(LINKS), default="nvlink",
                   help="disaggregated: the link that carries each prompt's KV cache")


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
    _plan_args(sub)
    sv = sub.add_parser("serve", formatter_class=FORMATTER, help="serve OpenAI's API over HTTP",
                        description="An OpenAI-compatible HTTP server (as vLLM serves the API): POST "
                                    "/v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, "
                                    "/health, /metrics (Prometheus), POST /tokenize and /detokenize, GET "
                                    "/tokenizer_info. SIGTERM drains, then exits.")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--port", type=_checked(int, lambda v: 0 <= v < 65536, "a port in [0, 65535]"),
                    default=8000, help="TCP port")
    sv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    sv.add_argument("--max-waiting-requests", type=positive_int, default=1024, metavar="N",
                    help="answer 503 (with Retry-After) rather than let more than N requests wait")
    sv.add_argument("--chat-template", default=None, metavar="PATH",
                    help="a Jinja chat template (default: the checkpoint's own, else the byte-level layout)")
    sv.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0, metavar="S",
                    help="on SIGTERM, seconds the requests in flight may take to finish before they are aborted")
    sv.add_argument("--kv-events-config", default=None, metavar="JSON",
                    help="publish prefix-cache events for KV-aware routers, as vLLM does: e.g. "
                         "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                         "\"tcp://*:5557\", \"topic\": \"kv\"}' (vLLM's fields; see entrypoints/server/kv_events.py)")
    sv.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                    help="prefill/decode disaggregation with vLLM's kv_transfer_params: '{\"kv_connector\": "
                         "\"MinibatchConnector\", \"kv_role\": \"kv_producer\"}' for a prefill replica, "
                         "kv_consumer for a decode replica, kv_both for either (see entrypoints/server/kv_transfer.py)")
    _connection_args(sv)
    _access_args(sv)
    _bench_args(sv, False, serve=True)
    _route_args(sub)
    return parser


def _int_list(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if not values or min(values) < 1:
        raise ValueError("empty or < 1")
    return values


def _plan_args(sub) -> None:
    from ..cluster.planner import (DEFAULT_BUDGETS, DEFAULT_MAX_GPUS, DEFAULT_NUM_REQUESTS, DEFAULT_PP_SIZES,
                                   DEFAULT_ROUTER, DEFAULT_TP_SIZES)
    from ..cluster.pricing import GPU_HOUR_USD, PRICE_SOURCE
    from ..cluster.router import ROUTER_POLICIES
    ints = _checked(_int_list, lambda v: True, "integers >= 1, comma-separated (e.g. 1,2,4,8)")
    join = lambda v: ",".join(map(str, v))    # noqa: E731
    pl = sub.add_parser("plan", formatter_class=FORMATTER, help="size a deployment: fewest GPUs that meet an SLO",
                        description="Search tensor parallelism x pipeline parallelism x replicas x the chunked-"
                                    "prefill token budget for the fewest simulated GPUs whose run of the workload "
                                    "at --rate keeps the --percentile TTFT and TPOT within the SLO. Prints the "
                                    "plan, its cost per million output tokens, MFU and MBU, and the runner-ups.")
    pl.add_argument("--model", required=True, choices=sorted(PRESETS), help="model shape to deploy")
    pl.add_argument("--gpu", required=True, choices=[g.name for g in GPUS.values()], help="GPU kind")
    pl.add_argument("--workload", default="azure-conv", metavar="NAME|CSV",
                    help="a trace (" + ", ".join(TRACE_FILES) + ", or a trace CSV) or a synthetic workload ("
                         + ", ".join(workload_names()) + ", with Poisson arrivals)")
    pl.add_argument("--rate", type=positive_float, required=True, metavar="R",
                    help="requests/s to serve (a trace's window is replayed at this mean rate)")
    pl.add_argument("--slo-ttft-ms", type=positive_float, default=500.0, metavar="MS", help="TTFT target")
    pl.add_argument("--slo-tpot-ms", type=positive_float, default=50.0, metavar="MS", help="TPOT target")
    pl.add_argument("--percentile", type=_checked(float, lambda v: 0 < v < 100, "a percentile in (0, 100)"),
                    default=90.0, metavar="P",
                    help="the SLO holds for this percentile of TTFT and of TPOT (default: 90, DistServe's "
                         "attainment target; p99 of a few hundred simulated requests rests on a handful of "
                         "them, so 99 needs a larger --num-requests; MLPerf's server scenario uses 99)")
    prices = ", ".join(f"{k} ${v.usd_per_gpu_hour:.2f}" for k, v in GPU_HOUR_USD.items())
    pl.add_argument("--gpu-hour-usd", type=positive_float, default=None, metavar="USD",
                    help=f"price of one GPU for an hour (default: {prices}; from {PRICE_SOURCE} Prices change "
                         "monthly and vary 2-3x between providers: pass yours)")
    pl.add_argument("--tp", type=ints, default=DEFAULT_TP_SIZES, metavar="N,N,...",
                    help=f"tensor-parallel sizes to try (default: {join(DEFAULT_TP_SIZES)}: one NVLink node)")
    pl.add_argument("--pp", type=ints, default=DEFAULT_PP_SIZES, metavar="N,N,...",
                    help=f"pipeline-parallel sizes to try (default: {join(DEFAULT_PP_SIZES)})")
    pl.add_argument("--budgets", type=ints, default=DEFAULT_BUDGETS, metavar="T,T,...",
                    help=f"chunked-prefill token budgets to try (default: {join(DEFAULT_BUDGETS)})")
    pl.add_argument("--max-gpus", type=positive_int, default=DEFAULT_MAX_GPUS, metavar="N",
                    help="the most GPUs a plan may use")
    pl.add_argument("--max-batch", type=positive_int, default=256, help="most sequences per step (max_num_seqs)")
    pl.add_argument("--router", choices=list(ROUTER_POLICIES), default=DEFAULT_ROUTER,
                    help="how requests are spread over the replicas")
    pl.add_argument("--num-requests", type=positive_int, default=DEFAULT_NUM_REQUESTS, metavar="N",
                    help="requests simulated per candidate (a trace: the window's first N)")
    pl.add_argument("--trace-start", type=non_negative_float, default=0.0, metavar="S",
                    help="a trace: start the window S trace seconds in")
    pl.add_argument("--trace-duration", type=positive_float, default=None, metavar="S",
                    help="a trace: the window's length in trace seconds (default: as long as N requests need)")
    pl.add_argument("--seed", type=seed_int, default=0, help="workload seed")
    pl.add_argument("--exhaustive", action="store_true",
                    help="find every configuration's own fewest replicas, not only those that could beat the "
                         "best plan so far (more simulations)")
    pl.add_argument("--rows", type=positive_int, default=10, help="runner-up rows to print")
    pl.add_argument("--json", metavar="PATH", help="write the plan, every candidate and the skipped configurations")
    pl.add_argument("--no-progress", action="store_true", help="no progress bar")


def _plan(args) -> int:
    import json
    from ..cluster.planner import NoPlanError, format_plan, plan_deployment
    opts = dict(rate=args.rate, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                percentile=args.percentile, gpu_hour_usd=args.gpu_hour_usd, tp_sizes=args.tp, pp_sizes=args.pp,
                budgets=args.budgets, max_gpus=args.max_gpus, num_requests=args.num_requests,
                trace_start=args.trace_start, trace_duration=args.trace_duration, seed=args.seed,
                router=args.router, max_batch=args.max_batch, prune=not args.exhaustive,
                progress=not args.no_progress)
    try:
        plan, error = plan_deployment(args.model, args.gpu, args.workload, **opts), None
    except NoPlanError as e:
        plan, error = e.plan, e
    print(format_plan(plan, rows=args.rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.to_dict(), f, indent=1)
        print(f"json: {args.json}")
    if error is not None:
        raise error
    return 0


def _access_args(p: argparse.ArgumentParser) -> None:
    """serve's deployment options: API key, CORS, metric names (entrypoints/server/access.py, entrypoints/server/metrics.py)."""
    g = p.add_argument_group("deployment (API key, CORS, metric names)")
    g.add_argument("--api-key", dest="server_api_key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise; /health, /metrics, "
                        "/tokenize stay open, as in vLLM); default: $MINIBATCH_API_KEY, else $VLLM_API_KEY, "
                        "else no key")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="CORS: web origins a browser may call from (e.g. http://localhost:3000, or '*'); "
                        "default none (vLLM's default is '*')")
    g.add_argument("--allowed-methods", nargs="+", default=["GET", "POST", "OPTIONS"], metavar="M",
                   help="CORS: methods allowed from those origins")
    g.add_argument("--allowed-headers", nargs="+", default=["Authorization", "Content-Type"], metavar="H",
                   help="CORS: request headers allowed from those origins ('*': whatever is asked)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and credentials")
    g.add_argument("--metrics-prefix", nargs="+", default=["minibatch"], metavar="P",
                   help="names of /metrics series: 'vllm' gives vllm:num_requests_waiting etc., so vLLM's "
                        "dashboards and gateways read them unchanged; several prefixes serve each series "
                        "under each")


def _access_options(args) -> dict:
    from .server.access import CorsPolicy, api_key_from_env
    key = args.server_api_key or ([api_key_from_env()] if api_key_from_env() else None)
    cors = None
    if args.allowed_origins:
        cors = CorsPolicy(tuple(args.allowed_origins), tuple(m.upper() for m in args.allowed_methods),
                          tuple(args.allowed_headers), args.allow_credentials)
    return {"api_keys": key, "cors": cors, "metrics_prefixes": tuple(args.metrics_prefix)}


def _route_args(sub) -> None:
    from ..cluster.router import ROUTER_POLICIES
    rt = sub.add_parser("route", formatter_class=FORMATTER, help="route OpenAI's API over several servers",
                        description="An OpenAI-compatible router in front of several servers (minibatch-engine "
                                    "serve, vLLM, SGLang): each request goes to one backend, chosen by a "
                                    "chapter 12 policy, and its reply streams back unchanged. GET /metrics "
                                    "has the router's series and every backend's, labelled by backend.")
    rt.add_argument("--backend", action="append", required=True, metavar="URL",
                    help="a server's URL, e.g. http://127.0.0.1:8000 (repeat for each backend)")
    rt.add_argument("--policy", choices=list(ROUTER_POLICIES), default="round-robin",
                    help="how a backend is chosen")
    rt.add_argument("--max-imbalance", type=non_negative_int, default=None, metavar="R",
                    help="--policy prefix: consider only backends with at most R more requests in flight "
                         "than the least busy (default: the policy's, 8)")
    rt.add_argument("--model", default=None, metavar="M",
                    help="key text prompts by this model's tokenizer ('tiny', 'tiny-py', a checkpoint "
                         "directory); default: by their UTF-8 bytes (token-id prompts are keyed exactly)")
    rt.add_argument("--block-size", type=positive_int, default=16, metavar="B",
                    help="tokens per block of the router's prefix index (the backends' KV block size)")
    rt.add_argument("--poll-interval", type=positive_float, default=0.5, metavar="S",
                    help="seconds between polls of each backend's /health and /metrics")
    rt.add_argument("--api-key", dest="router_api_key", default=None, metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on /v1/* and send it to the backends (their "
                         "serve --api-key); default: $MINIBATCH_API_KEY, else $VLLM_API_KEY, else none (a "
                         "client's key passes through)")
    rt.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    rt.add_argument("--port", type=_checked(int, lambda v: 0 <= v < 65536, "a port in [0, 65535]"),
                    default=8080, help="TCP port")
    _connection_args(rt)


def _connection_args(p: argparse.ArgumentParser) -> None:
    """What serve and route allow a client connection (entrypoints/server/limits.py)."""
    g = p.add_argument_group("client connections (slow or idle clients cannot hold the server)")
    g.add_argument("--header-timeout", type=positive_float, default=30.0, metavar="S",
                   help="close a connection that has not sent a whole request head S seconds after it "
                        "opened or after its previous response (idle keep-alive connections too)")
    g.add_argument("--body-timeout", type=positive_float, default=60.0, metavar="S",
                   help="answer 408 and close when a request body has not all arrived S seconds after "
                        "its headers")
    g.add_argument("--max-connections", type=positive_int, default=1024, metavar="N",
                   help="at N open connections a new one closes the oldest idle (or still sending its "
                        "headers); if all N are serving requests, the new one gets 503 with Retry-After. N is "
                        "lowered, with a log line, to fit the open-file limit (ulimit -n)")


def _limits(args):
    from .server.limits import ConnectionLimits
    return ConnectionLimits(args.header_timeout, args.body_timeout, args.max_connections)


def _check_host(host: str, port: int) -> None:
    """Refuse an address to listen on that does not resolve, before the model is built."""
    import socket
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {host!r} is not an address this machine can listen on ({e}); "
                         "e.g. 127.0.0.1, 0.0.0.0 or ::1") from None


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:            # --help (0) or a usage error (2, one line printed)
        return e.code
    # whole progress lines (the comparisons' rounds) read fine in a pipe or a log file; bars do not
    args.progress_lines = getattr(args, "no_progress", True) is False
    if getattr(args, "no_progress", True) is False and not sys.stderr.isatty():
        args.no_progress = True         # piped: a cleared bar would share the result's first line
    try:
        _check_output_paths(args)
        if args.command in ("bench", "simulate", "sweep"):
            _resolve_workload(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "sweep":
            return _sweep(args)
        if args.command == "simulate" and _is_cluster(args):
            return _cluster(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "route":
            return _route(args)
        return _bench(args, simulate=args.command == "simulate")
    except (ValueError, TypeError, KeyError, OSError, NotImplementedError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        if isinstance(e, OSError) and e.filename is not None:      # e.g. --json naming a directory
            msg = f"{e.strerror}: {e.filename}"
        print(f"error: {_flag_names(str(msg), args.command)}", file=sys.stderr)
        return 2


def _resolve_workload(args) -> None:
    """A synthetic workload's defaults (uniform, 64 requests), or a trace replay:
    ``args.workload`` becomes the :class:`~minibatch_engine.harness.request_traces.TraceWorkload`,
    ``args.num_requests`` the count it replays."""
    from ..model.config import PRESETS
    from ..harness.request_traces import trace_workload
    trace = args.trace if args.trace is not None else args.workload if args.workload in TRACE_FILES else None
    if trace is None:
        used = [f for f, v in (("--trace-start", args.trace_start != 0), ("--trace-duration", args.trace_duration),
                               ("--time-scale", args.time_scale), ("--trace-clip", args.trace_clip)) if v]
        if used:
            raise ValueError(f"{', '.join(used)} shape a trace replay: add --workload azure-conv|azure-code "
                             "or --trace PATH")
        args.workload = args.workload or "uniform"
        args.num_requests = args.num_requests or 64
        return
    if args.trace is not None and args.workload is not None:
        raise ValueError(f"give --trace {args.trace} or --workload {args.workload}, not both")
    if getattr(args, "arrival_rate", None) is not None or args.burstiness != 1 or args.clients:
        raise ValueError("a trace brings its own arrivals: drop --arrival-rate, --burstiness and --clients "
                         "(--time-scale X replays it X times faster)")
    if args.command == "sweep" and args.time_scale is not None:
        raise ValueError("sweep --rates sets the time scale of a trace (scale = rate / the trace's rate): "
                         "drop --time-scale")
    sim_model = getattr(args, "sim_model", None)
    if args.max_model_len is None and sim_model is not None:
        args.max_model_len = PRESETS[sim_model].max_position     # the simulated model's whole context
    wl = trace_workload(trace, args.trace_start, args.trace_duration, args.time_scale or 1.0,
                        clip=args.trace_clip, max_model_len=args.max_model_len)
    args.workload, args.num_requests = wl, min(args.num_requests or len(wl.trace), len(wl.trace))


# the engine's field names, as the engine's own checks name them -> the flags that set them
FLAG_OF_FIELD = {"max_num_seqs": "--max-batch", "max_model_len": "--max-model-len", "kv_budget_bytes": "--kv-budget",
                 "block_size": "--block-size", "max_num_batched_tokens": "--max-num-batched-tokens",
                 "tensor_parallel_size": "--tp", "pipeline_parallel_size": "--pp", "expert_parallel_size": "--ep",
                 "expert_load_imbalance": "--expert-imbalance", "swap_space_bytes": "--swap-space",
                 "priority_aging_s": "--priority-aging-s", "num_speculative_tokens": "--num-speculative-tokens",
                 "preemption_mode": "--preemption", "kv_layout": "--kv"}


def _flag_names(msg: str, command: str) -> str:
    """An engine error as the CLI user knows it: each field named by its flag."""
    import re
    if command == "route":                  # the router's options are not the engine's
        return msg
    return re.sub(r"\b(" + "|".join(FLAG_OF_FIELD) + r")\b", lambda m: FLAG_OF_FIELD[m.group(1)], msg)


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
        if not _writable(path, parent):
            raise ValueError(f"--{flag} {path}: cannot write there (no permission); name a file in a "
                             "writable folder")


def _writable(path: str, parent: str) -> bool:
    """Whether ``path`` can be written: tried for real (a probe file in its folder),
    since permission bits say nothing of read-only mounts or of root."""
    import tempfile
    if os.path.exists(path):
        return os.access(path, os.W_OK)
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".minibatch-probe-"):
            return True
    except OSError:
        return False


def _generate(args) -> int:
    from ..llm import LLM
    from ..sampling.params import SamplingParams
    llm = LLM(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
              scheduler=args.scheduler,
              max_num_seqs=max(1, len(args.prompts)), attention_backend=args.attention_backend,
              cpu_threads=args.cpu_threads, cpu_threads_follow_load=not args.cpu_threads_fixed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.model == "tiny":
        print("note: 'tiny' has seeded random weights, so its text is noise (the same on every machine)",
              file=sys.stderr)
    for out in llm.generate(args.prompts, params, use_tqdm=not args.no_progress):
        c = out.outputs[0]
        print(f"[{out.request_id}] {out.prompt!r} -> {c.text!r}  "
              f"({len(c.token_ids)} tokens, finished: {c.finish_reason})")
    return 0


def _engine_options(args) -> dict:
    """The EngineConfig fields the bench-like commands share."""
    return dict(kv_layout=args.kv or "auto", kv_budget_bytes=args.kv_budget, block_size=args.block_size,
                kv_cache_dtype=args.kv_cache_dtype,
                tensor_parallel_size=getattr(args, "tp", 1),
                pipeline_parallel_size=getattr(args, "pp", 1),
                expert_parallel_size=getattr(args, "ep", 1),
                expert_load_imbalance=getattr(args, "expert_imbalance", 1.0),
                sim_weight_dtype=getattr(args, "weight_dtype", "auto"),
                enable_prefix_caching=not args.no_prefix_caching,
                max_num_batched_tokens="auto" if args.max_num_batched_tokens is None else args.max_num_batched_tokens,
                enable_chunked_prefill=not args.no_chunked_prefill,
                preemption_mode=args.preemption, swap_space_bytes=args.swap_space,
                policy=args.policy, priority_aging_s=args.priority_aging_s,
                cpu_threads_follow_load=not getattr(args, "cpu_threads_fixed", False))


def _spec_option(args) -> dict:
    if args.speculative_method is None:
        return {}
    from ..speculative.config import SpeculativeConfig
    return {"speculative": SpeculativeConfig(args.speculative_method, args.num_speculative_tokens,
                                             draft_model=args.draft_model if args.speculative_method == "draft_model"
                                             else None)}


@contextmanager
def _serve_extra(command: str):
    """Around the imports of a command that needs the ``serve`` extra: a missing
    package becomes an error that names it and the install that fixes it."""
    try:
        yield
    except ImportError as e:
        raise ValueError(f"{command} needs the serve extra ({e.name} is missing): "
                         "pip install 'minibatch-engine[serve]'") from None


def _serve(args) -> int:
    with _serve_extra("serve"):
        from .server import make_app, serve
    _check_host(args.host, args.port)
    app = make_app(args.model, served_model_name=args.served_model_name, max_waiting=args.max_waiting_requests,
                   chat_template=args.chat_template, limits=_limits(args), device=args.device, dtype=args.dtype,
                   quantization=args.quantization,
                   scheduler=args.scheduler, max_num_seqs=args.max_batch, max_model_len=args.max_model_len,
                   attention_backend=args.attention_backend, cpu_threads=args.cpu_threads,
                   kv_events_config=args.kv_events_config, kv_transfer_config=args.kv_transfer_config,
                   **_engine_options(args), **_spec_option(args), **_access_options(args))
    serve(app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout)
    return 0


def _router_key(args) -> str | None:
    from .server.access import api_key_from_env
    return args.router_api_key or api_key_from_env()


def _route(args) -> int:
    with _serve_extra("route"):
        from .server.router_app import build_router_app, route
    _check_host(args.host, args.port)
    app = build_router_app(args.backend, policy=args.policy, max_imbalance=args.max_imbalance,
                           model=args.model, block_size=args.block_size, poll_interval=args.poll_interval,
                           limits=_limits(args), api_key=_router_key(args))
    route(app, host=args.host, port=args.port)
    return 0


def _sweep(args) -> int:
    from ..harness.metrics import parse_goodput, parse_percentiles
    from ..harness.sweep import parse_rates, sweep
    if args.endpoint is not None:
        return _sweep_endpoint(args)
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
    return _sweep_report(args, rows, ps, slo, args.scheduler)


def _check_endpoint(args) -> None:
    """--endpoint: a well-formed URL, and no option that only the simulator reads."""
    from ..harness.endpoint_client import base_url
    base_url(args.endpoint, "--endpoint")
    sim = [f for f, v in (("--sim-gpu", args.sim_gpu), ("--sim-model", args.sim_model)) if v is not None]
    if sim:
        raise ValueError(f"--endpoint measures a real server on the wall clock; {' and '.join(sim)} would "
                         "price a simulated GPU instead: drop one or the other")


def _sweep_endpoint(args) -> int:
    from ..harness.endpoint_client import sweep_endpoint
    from ..harness.metrics import parse_goodput, parse_percentiles
    from ..harness.sweep import parse_rates
    _check_endpoint(args)
    rates, ps, slo = parse_rates(args.rates), parse_percentiles(args.percentiles), parse_goodput(args.goodput)
    rows = sweep_endpoint(args.endpoint, rates, model=args.model, workload=args.workload,
                          num_requests=args.num_requests, seed=args.seed, burstiness=args.burstiness,
                          percentiles=ps, goodput=slo, api_key=args.api_key, jsonl=args.jsonl,
                          progress=not args.no_progress)
    return _sweep_report(args, rows, ps, slo, rows[0]["model"])


def _sweep_report(args, rows, ps, slo, label) -> int:
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
        from ..book import plotting
        fig = plotting.load_curves({label: rows}, slo_ms=slo, stat=f"p{p}")
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"plot: {args.plot} (latency and throughput against the offered rate)")
    return 0


def _bench(args, simulate: bool) -> int:
    from ..harness.bench import format_report, run_bench, write_json
    if not simulate and args.endpoint is not None:
        return _bench_endpoint(args)
    if not simulate and args.vs_openvino:
        if args.vs_transformers:
            raise ValueError("--vs-openvino and --vs-transformers are two separate comparisons: give one")
        return _vs_openvino(args)
    if not simulate and args.size is not None:
        raise ValueError("--size creates a checkpoint for --vs-openvino: add --vs-openvino, or pass --model")
    if not simulate and args.also:
        raise ValueError("--also adds engines to --vs-openvino's rounds: add --vs-openvino")
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
                                "quantization": args.quantization,
                                "attention_backend": args.attention_backend, "cpu_threads": args.cpu_threads}))
    print(format_report(summary, simulated=simulate))
    if args.json:
        write_json(summary, args.json)
        print(f"json: {args.json}")
    if args.plot:
        from ..book import plotting
        paged = engine.config.kv_layout == "paged"     # resolved: never "auto" here
        fig = plotting.timeline(engine.trace, title=f"{args.scheduler} on {args.workload}",
                                ylabel="first KV block" if paged else "KV row")
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"plot: {args.plot} (the run's timeline)")
    return 0


def _is_cluster(args) -> bool:
    disagg = (args.prefill_replicas, args.decode_replicas)
    if (disagg[0] is None) != (disagg[1] is None):
        raise ValueError("disaggregation needs both --prefill-replicas and --decode-replicas")
    if disagg[0] is not None and args.replicas is not None:
        raise ValueError("give --replicas (co-located) or --prefill-replicas/--decode-replicas "
                         "(disaggregated), not both")
    if args.router is not None and args.replicas is None and disagg[0] is None:
        raise ValueError("--router needs --replicas N (or --prefill-replicas/--decode-replicas)")
    return args.replicas is not None or disagg[0] is not None


def _cluster(args) -> int:
    import json
    from ..cluster import simulate_cluster
    from ..cluster.disagg import simulate_disaggregated
    from ..harness.metrics import parse_percentiles
    if args.scheduler != "continuous" or args.clients or args.speculative_method:
        raise ValueError("a cluster runs continuous engines on one workload: drop --scheduler, --clients "
                         "and --speculative-method")
    opts = dict(workload=args.workload, num_requests=args.num_requests, arrival_rate=args.arrival_rate,
                burstiness=args.burstiness, seed=args.seed, sim_gpu=args.sim_gpu, sim_model=args.sim_model,
                max_batch=args.max_batch, percentiles=args.percentiles, goodput=args.goodput,
                progress=not args.no_progress, **_engine_options(args))
    if args.max_model_len is not None:
        opts["max_model_len"] = args.max_model_len
    if args.replicas is not None:
        s, _ = simulate_cluster(args.replicas, args.router or "round-robin", max_imbalance=args.max_imbalance,
                                prefix_source=args.prefix_source, **opts)
        print(f"{args.replicas} co-located replicas, router {s['router']}")
    else:
        s, _ = simulate_disaggregated(args.prefill_replicas, args.decode_replicas, args.link,
                                      router=args.router or "least-requests", **opts)
        print(f"{args.prefill_replicas} prefill + {args.decode_replicas} decode replicas over {s['link']} "
              f"(KV transfer mean {s['kv_transfer_ms_mean']:.3g} ms)")
    print(f"{'replica':>8} {'pool':>8} {'requests':>9} {'hit rate':>9} {'busy s':>9} {'TTFT p50':>10}")
    for r in s["per_replica"]:
        print(f"{r['index']:>8} {r['pool']:>8} {r['requests']:>9} {r['prefix_hit_rate']:>9.3f} "
              f"{r['busy_s']:>9.3g} {r.get('ttft_ms_p50', float('nan')):>8.4g}ms")
    p = f"{parse_percentiles(args.percentiles)[-1]:g}"
    offered = "" if args.arrival_rate is None else f" (offered {args.arrival_rate:g}/s)"
    roles = " (prefill and decode replicas do different work)" if args.replicas is None else ""
    print(f"total: {s['completed']} requests, {s['request_throughput']:.3g} req/s completed{offered}, TTFT p{p} "
          f"{s[f'ttft_ms_p{p}']:.4g} ms, TPOT p{p} {s[f'tpot_ms_p{p}']:.4g} ms, prefix hit rate "
          f"{s['prefix_hit_rate']:.3f}, load imbalance {s['load_imbalance']:.3f} (the busiest replica's busy "
          f"time over the mean{roles})"
          + (f", goodput {s['goodput']:.3g} req/s ({s['goodput_per_gpu']:.3g} per GPU)" if "goodput" in s else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1, default=str)
        print(f"json: {args.json}")
    if args.plot:
        raise ValueError("--plot draws one engine's timeline; a cluster run has none (use --json)")
    return 0


def _bench_endpoint(args) -> int:
    from ..harness.bench import format_report, write_json
    from ..harness.endpoint_client import bench_endpoint
    _check_endpoint(args)
    if args.clients or args.workload == "mixed-classes" or args.vs_transformers or args.vs_openvino or args.plot:
        raise ValueError("--endpoint measures one stream of requests: drop --clients, --vs-transformers, --vs-openvino, "
                         "--plot and the mixed-classes workload")
    summary = bench_endpoint(args.endpoint, model=args.model, workload=args.workload,
                             num_requests=args.num_requests, seed=args.seed, arrival_rate=args.arrival_rate,
                             burstiness=args.burstiness, percentiles=args.percentiles, goodput=args.goodput,
                             api_key=args.api_key, progress=not args.no_progress)
    print(format_report(summary))
    if args.json:
        write_json(summary, args.json)
    return 0


def _vs_transformers(args) -> int:
    from ..harness.bench import write_json
    from ..harness.vs_transformers import compare, format_comparison, stored_difference
    if args.device not in ("auto", "cpu") or args.dtype != "float32":
        raise ValueError("--vs-transformers runs on the CPU in float32: drop --device/--dtype")
    backend = args.attention_backend
    try:
        summary = compare(args.model, num_requests=args.num_requests, batch=min(args.max_batch, args.num_requests),
                          seed=args.seed, rounds=args.rounds, threads=args.threads, attention_backend=backend,
                          workload=args.workload, log=(lambda *a: None) if not args.progress_lines else
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


def _vs_openvino(args) -> int:
    from ..harness.bench import write_json
    from ..harness.vs_openvino import DEFAULT_CACHE, compare, format_comparison
    if args.device not in ("auto", "cpu") or args.dtype != "float32" or args.quantization:
        raise ValueError("--vs-openvino runs on the CPU in float32: drop --device/--dtype/--quantization")
    if args.size is not None and args.model != "tiny":
        raise ValueError("--size creates its own checkpoint: give --size or --model, not both")
    also = tuple(x.strip() for x in args.also.split(",") if x.strip())
    try:
        summary = compare(args.model, size=args.size, num_requests=args.num_requests, also=also,
                          batch=min(args.max_batch, args.num_requests), seed=args.seed, rounds=args.rounds,
                          threads=args.threads, attention_backend=args.attention_backend, workload=args.workload,
                          cache_dir=args.openvino_cache or DEFAULT_CACHE,
                          log=(lambda *a: None) if not args.progress_lines else (lambda m: print(m, file=sys.stderr)))
    except ImportError as e:
        raise ValueError(str(e)) from None
    print(format_comparison(summary))
    if args.json:
        write_json(summary, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
