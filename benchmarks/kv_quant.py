"""What fp8 and int8 KV caches cost in accuracy and buy in capacity, measured.

    PYTHONPATH=. python benchmarks/kv_quant.py            # print the tables
    PYTHONPATH=. python benchmarks/kv_quant.py --write    # and save kv_quant.md, kv_quant.json

Accuracy (deterministic: float64, CPU, no sampling): tiny-py on Python source it
was not trained on (``json/decoder.py`` of the standard library; static scales
calibrated on ``json/encoder.py``), and the seeded random ``tiny`` Llama on the
same tokens, each KV format and scale granularity against the float cache
(:mod:`minibatch_engine.model.kv_quant_accuracy`). Capacity: one workload at one KV
byte budget for auto / fp8 / int8 (:mod:`minibatch_engine.book.kv_capacity`);
its blocks, concurrency, preemptions and steps are deterministic, its
throughput and TPOT wall-clock.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from minibatch_engine.book.kv_capacity import kv_dtypes_under_load
from minibatch_engine.model import kv_quant_accuracy as qa
from minibatch_engine.model import build_model
from minibatch_engine.model.registry import resolve_model, tokenizer_for
from minibatch_engine.model.trained import trained_model_path

TEXT_TOKENS, PROMPT_TOKENS, GEN_TOKENS, PROMPT_STARTS = 512, 32, 128, (0, 600, 1200, 1800)


def table(rows: list[dict], keys: list[str]) -> str:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> tuple[str, dict]:
    """The markdown tables, and the same rows by section (for the chapters to read)."""
    tok = tokenizer_for(trained_model_path("tiny-py"))
    ids = tok.encode(qa.held_out_python_text())
    calib = tok.encode(qa.held_out_python_text("json/encoder.py"))[:TEXT_TOKENS]
    prompts = [ids[i:i + PROMPT_TOKENS] for i in PROMPT_STARTS]
    out, data = [], {}
    for name, model in (("tiny-py", resolve_model("tiny-py", device="cpu", dtype="float64")),
                        ("random tiny Llama", build_model("tiny", device="cpu", dtype="float64"))):
        tf = qa.as_rows(qa.teacher_forced_metrics(model, ids[:TEXT_TOKENS], calib))
        data[f"{name}, teacher-forced"] = tf
        out.append(f"## {name}, teacher-forced on {TEXT_TOKENS} held-out tokens\n\n" + table(
            tf, ["kv_cache_dtype", "scale", "mean_kl", "max_kl", "mean_logprob_error", "top1_agreement",
                 "perplexity", "float_perplexity"]))
        ga = qa.as_rows(qa.greedy_agreement(model, prompts, GEN_TOKENS, calib))
        data[f"{name}, greedy"] = ga
        out.append(f"## {name}, greedy: {len(prompts)} prompts x {GEN_TOKENS} tokens\n\n" + table(
            ga, ["kv_cache_dtype", "scale", "token_agreement", "identical_runs", "mean_first_divergence",
                 "divergence_margins", "median_margin"]))
        for kv in ("int8", "fp8"):
            prof = qa.kv_error_profile(model, ids[:TEXT_TOKENS], calib, kv)
            data[f"{name}, {kv} round-trip error"] = prof
            out.append(f"## {name}, {kv} round-trip error of K and V (relative RMS)\n\n" + table(
                prof, ["layer", "kv", "peak_to_rms", "channel_peak_to_mean", "per_token_head", "per_head",
                       "per_tensor"]))
    cap = kv_dtypes_under_load(2048 * 16 * 128, num_requests=32, max_batch=32)
    out.append("## tiny-py (bfloat16) under load: 32 requests (uniform workload), 4 MiB of KV\n\n" + table(
        cap, list(cap[0])))
    data["tiny-py under load"] = cap
    data["setup"] = {"text_tokens": TEXT_TOKENS, "prompt_tokens": PROMPT_TOKENS, "gen_tokens": GEN_TOKENS,
                     "prompts": len(prompts), "dtype": "float64"}
    return "\n\n".join(out) + "\n", data


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="save the tables to benchmarks/kv_quant.md and their rows to kv_quant.json")
    args = ap.parse_args()
    text, data = main()
    print(text)
    if args.write:
        Path(__file__).with_name("kv_quant.json").write_text(json.dumps(data, indent=1) + "\n")
        Path(__file__).with_name("kv_quant.md").write_text("# KV-cache quantization, measured\n\n"
                                                           "`PYTHONPATH=. python benchmarks/kv_quant.py --write`\n\n"
                                                           + text)
