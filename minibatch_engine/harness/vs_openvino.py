"""This engine beside OpenVINO GenAI's continuous batching, on the same checkpoint.

``python -m minibatch_engine bench --vs-openvino`` (or ``benchmarks/vs_openvino.py``)
measures what a user choosing a CPU serving engine would measure. It takes a
local Hugging Face Llama checkpoint (``--model DIR``; ``tiny``, the built-in
3M-parameter model saved as one; or ``--size 125m``, a seeded random ~125M
Llama it creates), exports it once with optimum-intel to OpenVINO IR with fp32
weights (cached by the checkpoint's content), and runs one seeded workload (the
``uniform`` mix: prompts 16-128 tokens, outputs 8-256, greedy, fixed output
lengths) in one process, alternating round by round, through two systems:

* ``openvino``: OpenVINO GenAI's ``ContinuousBatchingPipeline`` (C++, paged
  attention) with fp32 inference and KV cache (``INFERENCE_PRECISION_HINT``,
  ``KV_CACHE_PRECISION``), ``INFERENCE_NUM_THREADS`` threads, ``max_num_seqs``
  equal to the engine's batch, and each request's length fixed by
  ``max_new_tokens`` with ``ignore_eos`` (not ``min_new_tokens``: that masks
  the EOS token's logit, so a greedy request whose argmax is EOS would take the
  runner-up and part from the engine, which keeps the model's own argmax);
* ``engine``: this engine, loading the same checkpoint through its own
  Hugging Face loader, with the same threads, batch and KV cache size, and
  prefix caching off in both (OpenVINO's cache would outlive a round, since
  one pipeline serves every round, while each round builds a fresh engine). Each round's engine
  is built (KV cache, thread count) before its timer starts, as the pipeline
  is built once before any; the timer covers the run alone.

The report gives each round's output tokens per second, the median over rounds,
the median of the per-round ratios, and token agreement: how many requests give
identical greedy tokens in both. OpenVINO GenAI and optimum-intel are optional
(the ``openvino`` extra); without them this module says how to install them.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch

from .cpu_engines import OtherEngine, Unavailable, check_names
from .cpu_engines import start as start_other
from .rounds import timed_rounds

SIZES = ("tiny", "125m")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minibatch-engine" / "openvino"
MISSING = ("--vs-openvino needs OpenVINO GenAI and optimum-intel (the optional extra `openvino`): "
           "pip install 'minibatch-engine[openvino]' (best in its own virtual environment: optimum-intel "
           "pins its own transformers and torch releases)")


def _require_openvino():
    """``openvino_genai``, or an ImportError that names the extra."""
    try:
        import openvino_genai
        import optimum.intel  # noqa: F401  (the exporter)
    except ImportError:
        raise ImportError(MISSING) from None
    return openvino_genai


def llama_125m_config():
    """The issue's second size: a ~125M-parameter Llama (hidden 768, 12 layers,
    12 query heads and 4 KV heads of 64, MLP 2048, vocabulary 32,000)."""
    from ..model.config import ModelConfig
    return ModelConfig(family="llama", name="llama-125m", vocab_size=32000, hidden_size=768, num_layers=12,
                       num_heads=12, num_kv_heads=4, intermediate_size=2048, max_position=2048)


def make_checkpoint(size: str, folder: str | Path, seed: int = 0) -> Path:
    """A seeded random Llama of ``size`` (``tiny``: the built-in 3M model;
    ``125m``) saved as a Hugging Face checkpoint under ``folder``; an existing
    one is reused (the weights depend only on the size and the seed)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    path = Path(folder) / f"llama-{size}-seed{seed}"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return path
    from ..model.hf_export import save_hf_checkpoint
    from ..model.transformer import build_model
    model = build_model("tiny" if size == "tiny" else llama_125m_config(), device="cpu", dtype="float32", seed=seed)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(model, tmp)
    tmp.rename(path)
    return path


def checkpoint_key(checkpoint: str | Path) -> str:
    """A short hash of a checkpoint's ``config.json`` and weight files: the
    name of its exported IR in the cache."""
    h = hashlib.sha256()
    root = Path(checkpoint)
    for f in sorted([root / "config.json", *root.glob("*.safetensors")]):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def export_openvino(checkpoint: str | Path, cache_dir: str | Path = DEFAULT_CACHE, log=print) -> tuple[Path, bool]:
    """The checkpoint as OpenVINO IR with fp32 weights, exported by optimum-intel
    (``optimum-cli export openvino --task text-generation-with-past
    --weight-format fp32``) into ``cache_dir/<content hash>``; returns the
    folder and whether this call exported it (False: reused from the cache)."""
    _require_openvino()
    out = Path(cache_dir) / f"ir-{checkpoint_key(checkpoint)}"
    if (out / "openvino_model.xml").is_file() and (out / "openvino_model.bin").is_file():
        return out, False
    import transformers
    from optimum.exporters.openvino import main_export
    from optimum.intel import OVConfig
    transformers.logging.set_verbosity_error()          # tracing warnings: not the user's concern
    transformers.utils.logging.disable_progress_bar()
    log(f"exporting {checkpoint} to OpenVINO IR (fp32 weights) in {out}...")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main_export(str(checkpoint), output=str(tmp), task="text-generation-with-past",
                    ov_config=OVConfig(dtype="fp32"), library_name="transformers")
    if not (tmp / "openvino_model.xml").is_file():
        raise RuntimeError(f"optimum-intel wrote no openvino_model.xml into {tmp}")
    tmp.rename(out)
    return out, True


def token_agreement(a: list[list[int]], b: list[list[int]]) -> int:
    """How many requests have identical token lists in ``a`` and ``b`` (same order)."""
    if len(a) != len(b):
        raise ValueError(f"token agreement needs as many requests on both sides, got {len(a)} and {len(b)}")
    return sum(list(x) == list(y) for x, y in zip(a, b))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first output position where two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def kv_cache_gb(hf_config: dict, prompts, max_tokens, margin: float = 1.5) -> int:
    """Whole gigabytes of fp32 KV cache that hold every request at once (with a margin)."""
    heads = hf_config.get("num_key_value_heads", hf_config["num_attention_heads"])
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    per_token = 2 * hf_config["num_hidden_layers"] * heads * head_dim * 4
    tokens = sum(len(p) + m for p, m in zip(prompts, max_tokens))
    return max(1, math.ceil(per_token * tokens * margin / 2**30))


def openvino_pipeline(ir: Path, batch: int, max_num_batched_tokens: int, cache_gb: int, threads: int):
    """OpenVINO GenAI's continuous-batching pipeline on the CPU, fp32 throughout,
    prefix caching off (its cache would outlive a round: the pipeline serves
    every round)."""
    ov_genai = _require_openvino()
    sc = ov_genai.SchedulerConfig()
    sc.max_num_seqs = batch
    sc.max_num_batched_tokens = max_num_batched_tokens
    sc.cache_size = cache_gb
    sc.enable_prefix_caching = False
    props = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "INFERENCE_NUM_THREADS": threads}
    return ov_genai.ContinuousBatchingPipeline(str(ir), sc, "CPU", props)


def openvino_adapter(checkpoint, cache_key, cache_dir, batch, threads, kv_tokens, log,
                     max_num_batched_tokens: int, cache_gb: int):
    """OpenVINO GenAI's pipeline on ``checkpoint``, as :func:`~.cpu_engines.start`
    runs it in a process of its own (its ``adapter``)."""
    ov_genai = _require_openvino()
    ir, _ = export_openvino(checkpoint, cache_dir, log)
    pipe = openvino_pipeline(ir, batch, max_num_batched_tokens, cache_gb, threads)
    eos = json.loads((Path(checkpoint) / "config.json").read_text()).get("eos_token_id")
    return OtherEngine("openvino", ov_genai.__version__,
                       f"ContinuousBatchingPipeline, max_num_seqs {batch}, max_num_batched_tokens "
                       f"{max_num_batched_tokens}, {cache_gb} GB fp32 KV cache, {threads} threads",
                       lambda prompts, max_tokens: run_openvino(pipe, prompts, max_tokens, eos))


def openvino_requests(prompts, max_tokens, eos_token_id: int | list | None = None) -> list[tuple]:
    """(prompt tensor, GenerationConfig) per request: greedy, exactly its own number
    of output tokens (``ignore_eos``). A checkpoint without an EOS token is given
    token 0 as one: GenAI refuses the -1 it would use, and ``ignore_eos`` lets
    token 0 through like any other; of a list of EOS tokens, the first."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai
    eos = eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id
    requests = []
    for p, m in zip(prompts, max_tokens):
        c = ov_genai.GenerationConfig()
        c.do_sample, c.ignore_eos, c.max_new_tokens = False, True, m
        c.set_eos_token_id(0 if eos is None else eos)
        requests.append((ov.Tensor(np.array([p], dtype=np.int64)), c))
    return requests


def run_openvino(pipe, prompts, max_tokens, eos_token_id: int | list | None = None) -> list[list[int]]:
    """The requests of :func:`openvino_requests` through the pipeline's ``generate``."""
    ids, configs = zip(*openvino_requests(prompts, max_tokens, eos_token_id))
    return [list(r.m_generation_ids[0]) for r in pipe.generate(list(ids), list(configs))]


def compare(model="tiny", size: str | None = None, num_requests: int = 64, batch: int = 64, seed: int = 0,
            rounds: int = 3, threads: int = 2, attention_backend: str = "auto", workload: str = "uniform",
            cache_dir: str | Path = DEFAULT_CACHE, also: tuple[str, ...] = (), warmup_rounds: int = 1,
            log=print) -> dict:
    """Run OpenVINO GenAI and the engine (and each system of ``also``, from
    :data:`~.cpu_engines.OTHERS`) ``rounds`` times each, rotating who goes
    first, after ``warmup_rounds`` untimed rounds of the whole workload; return
    a summary dict (see :func:`format_comparison`). A system of ``also`` that is
    not installed is skipped, with its reason in ``skipped``."""
    ov_genai = _require_openvino()
    check_names(also)

    import openvino as ov
    from .bench import cpu_name, warmup
    from .vs_transformers import engine_for
    from .workload import make_workload
    from ..attention import get_attention_backend
    from ..config import EngineConfig
    from ..model.registry import resolve_model
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        log(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs: other programs are running, "
            "which slows the two systems unequally and distorts the ratio")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    if size is not None:
        ckpt = make_checkpoint(size, cache_dir, seed)
    elif isinstance(model, str) and model.lower() == "tiny":
        ckpt = make_checkpoint("tiny", cache_dir, seed)
    else:
        ckpt = Path(model)
        if not (ckpt / "config.json").is_file():
            raise ValueError(f"--model {model!r}: --vs-openvino needs 'tiny' or a Hugging Face checkpoint directory")
    ir, exported = export_openvino(ckpt, cache_dir, log)
    torch.set_num_threads(threads)
    attention_backend = get_attention_backend(attention_backend, "cpu").name
    ours = resolve_model(str(ckpt), device="cpu", dtype="float32")
    hf_config = json.loads((ckpt / "config.json").read_text())
    specs = make_workload(workload, num_requests, seed=seed, vocab_size=min(256, ours.config.vocab_size))
    prompts = [s.prompt_token_ids for s in specs]
    max_tokens = [s.max_tokens for s in specs]
    output_tokens = sum(max_tokens)
    budget = EngineConfig(max_num_seqs=batch).resolve(ours.config).max_num_batched_tokens
    cache_gb = kv_cache_gb(hf_config, prompts, max_tokens)
    kv_tokens = sum(map(len, prompts)) + output_tokens
    # OpenVINO in a process of its own, like the --also systems (cpu_engines): the
    # engine's process-wide malloc settings (runner/cpu_memory.py) stay out of it
    pipe = start_other("openvino", ckpt, checkpoint_key(ckpt), cache_dir, batch, threads, kv_tokens, log,
                       adapter=openvino_adapter, max_num_batched_tokens=budget, cache_gb=cache_gb)
    runs = {"openvino": lambda: pipe.run(prompts, max_tokens), "engine": None}
    others, skipped = {"openvino": pipe}, {}
    for name in dict.fromkeys(also):
        try:
            others[name] = start_other(name, ckpt, checkpoint_key(ckpt), cache_dir, batch, threads, kv_tokens, log)
        except Unavailable as e:
            skipped[name] = str(e)
            log(f"skipping {name}: {e}")
    for name, other in others.items():
        runs.setdefault(name, lambda o=other: o.run(prompts, max_tokens))

    thread_changes = []     # per engine run: how often its load follower changed the threads

    def engine_run():
        """A fresh engine holding the workload, built before the timer (as the
        pipeline is): its run returns every request's tokens."""
        eng, reqs = engine_for(ours, prompts, max_tokens, batch, attention_backend, threads,
                               kv_budget_bytes=cache_gb * 2**30, enable_prefix_caching=False)

        def run():
            eng.run()
            follower = getattr(eng.runner, "load_follower", None)
            thread_changes.append(follower.changes if follower is not None else 0)
            return [list(r.output_token_ids) for r in reqs]
        return run

    log(f"warming up {len(runs)} systems (untimed)...")
    warmup(ours)
    try:
        for other in others.values():
            other.run(prompts[:2], [4, 4])
        results = timed_rounds(runs, rounds, output_tokens, log, prepare={"engine": engine_run},
                               warmup_rounds=warmup_rounds)
    finally:
        for other in others.values():
            other.close()
    ov_toks, eng_toks = results["openvino"].tokens, results["engine"].tokens
    diffs = [first_difference(a, b) for a, b in zip(eng_toks, ov_toks)]
    per_round = [o / e for o, e in zip(results["openvino"].seconds, results["engine"].seconds)]
    n_params = sum(p.numel() for p in ours.parameters())
    return {
        "checkpoint": str(ckpt), "ir": str(ir), "exported_now": exported, "parameters": n_params,
        "workload": workload, "num_requests": num_requests, "batch": batch, "seed": seed, "rounds": rounds,
        "warmup_rounds": warmup_rounds, "threads": threads, "attention_backend": attention_backend, "output_tokens": output_tokens,
        "max_num_batched_tokens": budget, "openvino_kv_cache_gb": cache_gb,
        "torch": torch.__version__, "openvino": ov.__version__, "openvino_genai": ov_genai.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cpu": f"{cpu_name()} ({os.cpu_count()} CPUs)",
        "load_average_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "systems": {name: {"seconds": res.seconds,
                           "tokens_per_second_per_round": [output_tokens / s for s in res.seconds],
                           "tokens_per_second": output_tokens / statistics.median(res.seconds)}
                    for name, res in results.items()},
        "engine_vs_openvino_per_round": per_round,
        "engine_thread_changes_per_round": thread_changes[-rounds:],
        "engine_vs_openvino_median": statistics.median(per_round),
        "requests_token_equal": token_agreement(eng_toks, ov_toks),
        "first_difference_positions": [d for d in diffs if d is not None],
        "others": {name: {"version": o.version, "settings": o.settings,
                          "engine_vs_per_round": [x / e for x, e in zip(results[name].seconds,
                                                                         results["engine"].seconds)],
                          "requests_token_equal_engine": token_agreement(eng_toks, results[name].tokens)}
                   for name, o in others.items() if name != "openvino"},
        "openvino_settings": pipe.settings,
        "skipped": skipped,
    }


def format_comparison(s: dict) -> str:
    ratio = s["engine_vs_openvino_median"]
    lines = [f"{Path(s['checkpoint']).name} ({s['parameters'] / 1e6:.1f}M parameters) on the {s['workload']} "
             f"workload: {s['num_requests']} requests, {s['output_tokens']:,} output tokens, greedy, fixed "
             f"lengths; batch {s['batch']}, {s['threads']} threads, fp32 weights and KV, {s['rounds']} "
             f"alternating round{'s' if s['rounds'] > 1 else ''} after {s.get('warmup_rounds', 0)} untimed "
             f"(torch {s['torch']}, "
             f"OpenVINO GenAI {s['openvino_genai']})"]
    width = max(10, *(len(name) + 2 for name in s["systems"]))
    lines.append(f"  {'system':<{width}}{'median tok/s':>14}   per round")
    for name, r in s["systems"].items():
        rounds = ", ".join(f"{t:,.0f}" for t in r["tokens_per_second_per_round"])
        lines.append(f"  {name:<{width}}{r['tokens_per_second']:>14,.0f}   {rounds}")
    lines.append(f"  engine / OpenVINO: {ratio:.2f}x (median of the per-round ratios "
                 f"{', '.join(f'{x:.2f}' for x in s['engine_vs_openvino_per_round'])})")
    changes = s.get("engine_thread_changes_per_round", [])
    if any(changes):
        lines.append(f"  the engine's load follower changed its threads in the rounds: {changes} times "
                     "(other processes took CPU time)")
    lines.append(f"  token agreement: {s['requests_token_equal']}/{s['num_requests']} requests identical"
                 + (f" (first differences at output positions {sorted(s['first_difference_positions'])[:8]})"
                    if s["first_difference_positions"] else ""))
    for name, o in s.get("others", {}).items():
        r = o["engine_vs_per_round"]
        lines.append(f"  engine / {name} {o['version']}: {statistics.median(r):.2f}x (per round "
                     f"{', '.join(f'{x:.2f}' for x in r)}); {o['requests_token_equal_engine']}/{s['num_requests']} "
                     f"requests token-identical to the engine; {o['settings']}")
    for name, why in s.get("skipped", {}).items():
        lines.append(f"  {name}: skipped ({why})")
    load = s.get("load_average_at_end")
    if load is not None:     # the one-minute average counts the run's own threads: take them out
        others = load - s["threads"]
        lines.append(f"  load average at the end: {load:.2f} on {os.cpu_count()} CPUs, {s['threads']} of it "
                     "the benchmark's own threads"
                     + (" (others were busy: the ratio is distorted; compare on a quiet machine)"
                        if others > 0.5 * (os.cpu_count() or 1) else ""))
    return "\n".join(lines)
