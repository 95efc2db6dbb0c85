"""This engine beside Hugging Face ``transformers``, on the same weights.

``python -m minibatch_engine bench --vs-transformers`` (or
``benchmarks/vs_transformers.py``) saves the chosen model as a Hugging Face
checkpoint, builds one seeded workload (the ``uniform`` mix: prompts 16-128
tokens, outputs 8-256, greedy, ``ignore_eos``) and runs it, in one process and
alternating round by round, through three systems:

* ``hf-static``: ``model.generate`` on left-padded batches of ``batch`` prompts;
  each batch runs until its longest output is done (static batching, chapter 2),
  and only each request's own tokens are counted;
* ``hf-continuous``: transformers' own continuous batching
  (``init_continuous_batching``: a paged cache and a scheduler on a background
  thread), each request with its own ``max_new_tokens``;
* ``engine``: this engine (continuous, paged, ``max_num_seqs=batch``).

Every system's greedy tokens are compared with the engine's, and the report
gives output tokens per second (median over rounds) and the ratios.
``transformers`` is optional: without it this module says how to install it.
"""
from __future__ import annotations

import inspect
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from .rounds import timed_rounds

SYSTEMS = ("hf-static", "hf-continuous", "engine")


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("--vs-transformers needs Hugging Face transformers (an optional dependency): "
                          "pip install transformers") from None
    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    return transformers


def run_hf_static(hf, prompts, max_tokens, batch: int, pad_id: int) -> list[list[int]]:
    """Greedy ``generate`` over left-padded batches of ``batch`` prompts in order."""
    outs: list[list[int]] = []
    for b in range(0, len(prompts), batch):
        ps, ms = prompts[b:b + batch], max_tokens[b:b + batch]
        width = max(map(len, ps))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(ms), min_new_tokens=max(ms),
                          do_sample=False, pad_token_id=pad_id, eos_token_id=None)
        outs += [row[width:width + m].tolist() for row, m in zip(gen, ms)]
    return outs


def run_hf_continuous(hf, prompts, max_tokens, batch: int) -> list[list[int]]:
    """transformers' continuous batching: one request per prompt, its own output length;
    at most ``batch`` requests a step where the release can cap them (see
    :func:`hf_caps_batch`). Its paged cache is sized to hold the whole workload
    (:func:`hf_cache_blocks`), as the other systems' caches are: left to its
    default, transformers sizes the cache from the machine's free memory and
    allocates it inside every run (seconds on a CPU, for any workload)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(max_tokens))
    cap = {"max_requests_per_batch": batch} if hf_caps_batch() else {}
    cb_cfg = ContinuousBatchingConfig(num_blocks=hf_cache_blocks(prompts, max_tokens), **cap)
    results = {}
    manager_of = hf.continuous_batching_context_manager
    no_warmup = {"warmup": False} if "warmup" in inspect.signature(manager_of).parameters else {}  # else none
    with manager_of(generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=30,
                    **no_warmup) as manager:
        ids = [manager.add_request(p, max_new_tokens=m) for p, m in zip(prompts, max_tokens)]
        while len(results) < len(ids):
            r = manager.get_result(timeout=5)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped early")
                continue
            if r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"transformers' continuous batching failed on {r.request_id}: {r.error}")
                results[r.request_id] = list(r.generated_tokens)
    return [results[i] for i in ids]


HF_BLOCK_TOKENS = 256   # transformers' default page size (``page_size``, ``block_size`` before 5.6)


def hf_cache_blocks(prompts, max_tokens) -> int:
    """Pages of transformers' paged cache that hold every request at once."""
    return sum(-(-(len(p) + m) // HF_BLOCK_TOKENS) for p, m in zip(prompts, max_tokens)) + 1


def hf_caps_batch() -> bool:
    """Whether this transformers release can cap its continuous batch at a number
    of requests (``max_requests_per_batch``; releases before about 5.6 size the
    batch by tokens and memory alone)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    return "max_requests_per_batch" in inspect.signature(ContinuousBatchingConfig).parameters


def engine_for(model, prompts, max_tokens, batch: int, attention_backend: str, cpu_threads: int | str = "auto",
               **config):
    """This engine (continuous, paged, ``max_num_seqs=batch``, ``max_model_len``
    long enough for the workload's longest request, and any other
    :class:`~minibatch_engine.config.EngineConfig` knob in ``config``) and the
    workload's requests, added to it in order."""
    from ..core.engine import Engine
    from ..sampling.params import SamplingParams
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    config.setdefault("max_model_len", max(longest, min(model.config.max_position, 1024)))
    eng = Engine(model, max_num_seqs=batch, attention_backend=attention_backend, cpu_threads=cpu_threads, **config)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, max_tokens)]
    return eng, reqs


def run_engine(model, prompts, max_tokens, batch: int, attention_backend: str,
               cpu_threads: int | str = "auto") -> list[list[int]]:
    eng, reqs = engine_for(model, prompts, max_tokens, batch, attention_backend, cpu_threads)
    eng.run()
    return [list(r.output_token_ids) for r in reqs]


def compare(model="tiny", num_requests: int = 64, batch: int = 64, seed: int = 0, rounds: int = 3,
            threads: int | None = 2, attention_backend: str = "auto", workload: str = "uniform",
            log=print) -> dict:
    """Run the three systems ``rounds`` times each, alternating; return a summary dict."""
    log(estimate_line(num_requests, batch, rounds))
    log("loading transformers and converting the model to a Hugging Face checkpoint...")
    transformers = _require_transformers()
    from .bench import cpu_name, warmup
    from ..model.config import PAD_ID
    from ..model.hf_export import save_hf_checkpoint
    from ..model.registry import resolve_model
    from .workload import make_workload
    if threads:
        torch.set_num_threads(threads)
    from ..attention import get_attention_backend
    attention_backend = get_attention_backend(attention_backend, "cpu").name   # "auto" -> what ran
    ours = resolve_model(model, device="cpu", dtype="float32")
    with tempfile.TemporaryDirectory() as ckpt:
        save_hf_checkpoint(ours, ckpt)
        hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    specs = make_workload(workload, num_requests, seed=seed, vocab_size=min(256, ours.config.vocab_size))
    prompts = [s.prompt_token_ids for s in specs]
    max_tokens = [s.max_tokens for s in specs]
    output_tokens = sum(max_tokens)
    pad_id = PAD_ID if PAD_ID < ours.config.vocab_size else 0
    runs = {
        "hf-static": lambda: run_hf_static(hf, prompts, max_tokens, batch, pad_id),
        "hf-continuous": lambda: run_hf_continuous(hf, prompts, max_tokens, batch),
        "engine": lambda: run_engine(ours, prompts, max_tokens, batch, attention_backend, threads or "auto"),
    }
    # warm-ups, untimed: first-call allocations and kernel selection
    log("warming up the three systems (untimed)...")
    warmup(ours)
    with torch.no_grad():
        hf.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, pad_token_id=pad_id)
    results = timed_rounds({name: runs[name] for name in SYSTEMS}, rounds, output_tokens, log)
    # One more engine run, untimed by the rounds, with its attention timed from the
    # inside: where the engine's step time goes (attention, rest of model, engine).
    from .profiling import profile_run
    log("one more engine run with its attention timed from the inside...")
    shares = profile_run(engine_for(ours, prompts, max_tokens, batch, attention_backend, threads or "auto")[0])
    ref = results["engine"].tokens
    summary = {
        "model": model if isinstance(model, str) else ours.config.name,
        "workload": workload, "num_requests": num_requests, "batch": batch, "seed": seed,
        "rounds": rounds, "threads": torch.get_num_threads(), "attention_backend": attention_backend,
        "output_tokens": output_tokens, "torch": torch.__version__, "transformers": transformers.__version__,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "cpu": f"{cpu_name()} ({os.cpu_count()} CPUs)",
        "load_average_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "systems": {},
    }
    for name, res in results.items():
        same = sum(a == b for a, b in zip(res.tokens, ref))
        summary["systems"][name] = {"seconds": res.seconds, "tokens_per_second": res.tok_per_s(output_tokens),
                                    "requests_token_equal_to_engine": same}
    eng = summary["systems"]["engine"]["tokens_per_second"]
    summary["engine_vs_hf_static"] = eng / summary["systems"]["hf-static"]["tokens_per_second"]
    summary["engine_vs_hf_continuous"] = eng / summary["systems"]["hf-continuous"]["tokens_per_second"]
    summary["engine_time_shares"] = shares.as_dict()
    return summary


#: the run committed with the book (``minibatch-engine bench --vs-transformers --json``)
STORED = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_transformers.json"


def _stored() -> dict | None:
    try:
        return json.loads(STORED.read_text())
    except (OSError, ValueError):
        return None


def load_note() -> str | None:
    """A warning when other programs keep the CPUs busy (1-minute load average
    above half the CPUs): wall-clock ratios between systems are then distorted."""
    if not hasattr(os, "getloadavg"):
        return None
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load <= 0.5 * cpus:
        return None
    return (f"load average {load:.2f} on {cpus} CPUs: other programs are running, which slows the "
            "three systems unequally and distorts the ratios")


def estimate_line(num_requests: int, batch: int, rounds: int) -> str:
    """What to expect before a run: the stored run's time scaled to this one."""
    ref = _stored()
    msg = f"--vs-transformers: {rounds} rounds of three systems"
    if ref and ref.get("systems"):
        per_round = sum(sorted(r["seconds"])[len(r["seconds"]) // 2] for r in ref["systems"].values())
        scale = (num_requests / ref["num_requests"]) * (rounds / ref["rounds"])
        total = per_round * ref["rounds"] * scale + 30      # + loading and warm-up
        msg += (f"; about {total / 60:.0f} min on a quiet machine like the stored run's "
                f"({ref['cpu']}), longer on a busy one")
    note = load_note()
    return msg + (f"\n{note}" if note else "")


def stored_difference(s: dict, factor: float = 2.0) -> str | None:
    """A note when this run's engine/HF ratio differs from the stored one by more
    than ``factor`` either way: the load average, and what it does to the ratio."""
    ref = _stored()
    if not ref or ref.get("model") != s.get("model") or ref.get("num_requests") != s.get("num_requests"):
        return None
    key = "engine_vs_hf_continuous"
    ratio = s[key] / ref[key]
    if 1 / factor <= ratio <= factor:
        return None
    load = s.get("load_average_at_end")
    return (f"note: engine vs hf-continuous is {s[key]:.2f}x here against {ref[key]:.2f}x in the stored run "
            f"({STORED.name}, {ref['cpu']}, load average {ref.get('load_average_at_end', 0):.2f}); this "
            f"run ended at load average {load:.2f} on {os.cpu_count()} CPUs. A busy machine distorts the "
            "ratio: the systems use their threads differently, so other programs slow them unequally. "
            "Compare on a quiet machine.")


def format_comparison(s: dict) -> str:
    lines = [f"{s['model']} on the {s['workload']} workload: {s['num_requests']} requests, "
             f"{s['output_tokens']:,} output tokens, greedy, ignore_eos; batch {s['batch']}, "
             f"{s['threads']} threads, median of {s['rounds']} alternating rounds "
             f"(torch {s['torch']}, transformers {s['transformers']})",
             f"  {'system':<16}{'output tok/s':>14}{'engine is':>12}{'tokens equal':>15}"]
    eng = s["systems"]["engine"]["tokens_per_second"]
    for name, r in s["systems"].items():
        tps = r["tokens_per_second"]
        lines.append(f"  {name:<16}{tps:>10,.0f} tok/s{eng / tps:>11.2f}x"
                     f"{r['requests_token_equal_to_engine']:>10}/{s['num_requests']}")
    t = s.get("engine_time_shares")
    if t:
        lines.append(f"  engine step time (one more run, attention timed inside): attention {t['attention']:.0%} "
                     f"(its metadata {t['attention_metadata']:.0%}), "
                     f"rest of model {t['rest_of_model']:.0%}, engine {t['engine']:.1%}; "
                     f"engine {t['engine_at_large_batch']:.1%} in the {t['large_batch_steps']} decode steps "
                     f"of {t['large_batch_min_running']}+ requests ({t['engine_us_per_request']:.1f} us "
                     "per request)")
    return "\n".join(lines)
