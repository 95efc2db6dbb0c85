"""Which attention backend is fastest on this CPU? Per-step attention time and
whole-model step time at batch 64: the reference, sdpa and the C++ paged kernel.

    PYTHONPATH=. python benchmarks/attention_backends.py            # print the tables
    PYTHONPATH=. python benchmarks/attention_backends.py --write    # and save attention_backends.md

The tiny Llama shape (hidden 256, 4 heads, 2 KV heads, head_dim 64, 4 layers),
64 sequences with contexts drawn from 16..384 tokens, blocks of 16 tokens
scattered at random over the pool (as after a while of serving). Two steps:
64 decodes, and 62 decodes with two prefill chunks (a fresh 128-token prompt and
a 64-token chunk after 256 cached tokens). Every candidate runs in this one
process, alternating, several rounds; the tables give the best time of each
and ratios to the reference. Wall-clock numbers: other work on the machine
moves them, the ratios less so (the load average is printed with them).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from minibatch_engine.attention import get_attention_backend
from minibatch_engine.harness.bench import cpu_name
from minibatch_engine.attention.cpu_kernel import cpu_kernel_available
from minibatch_engine.attention.sdpa import SdpaBackend
from minibatch_engine.kv.pool import KVPool
from minibatch_engine.model import build_model

BLOCK_SIZE, NUM_SEQS = 16, 64


def make_step(kind: str, gen: torch.Generator):
    contexts = torch.randint(16, 385, (NUM_SEQS,), generator=gen).tolist()
    query_lens, seq_lens = [1] * NUM_SEQS, [c + 1 for c in contexts]
    if kind == "mixed":
        query_lens[-2:], seq_lens[-2:] = [128, 64], [128, 256 + 64]
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    perm = torch.randperm(sum(need), generator=gen).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    return query_lens, seq_lens, tables, sum(need)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def race(cands: dict, rounds: int) -> dict:
    """Best (least disturbed) seconds of each candidate, run alternately ``rounds``
    times after a warm-up. On a shared machine a run is only ever slowed down by
    others' work, so the minimum is the most faithful estimate."""
    for fn in cands.values():
        fn()
    times = {name: [] for name in cands}
    for _ in range(rounds):
        for name, fn in cands.items():
            times[name].append(timed(fn))
    return {name: min(ts) for name, ts in times.items()}


@torch.no_grad()
def main(rounds: int, write: bool, threads: int = 2) -> str:
    torch.set_num_threads(threads)
    model = build_model("tiny", device="cpu", dtype="float32")
    cfg = model.config
    backends = {"reference": get_attention_backend("reference"),
                "sdpa, one padded bucket": SdpaBackend(max_waste=0.999),
                "sdpa, a bucket per block count": SdpaBackend(max_waste=0.0),
                "sdpa (default, waste <= 1/8)": get_attention_backend("sdpa")}
    if cpu_kernel_available():
        backends["cpp (C++ paged kernel)"] = get_attention_backend("cpp")
    whole = [n for n in ("reference", "sdpa (default, waste <= 1/8)", "cpp (C++ paged kernel)") if n in backends]
    lines = [f"Measured {time.strftime('%Y-%m-%d')} on {cpu_name()}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
             f"{os.getloadavg()[0]:.1f} at the start (a shared machine), best of {rounds} "
             "alternating rounds.", ""]
    gen = torch.Generator().manual_seed(0)
    for kind in ("decode", "mixed"):
        ql, sl, tables, num_blocks = make_step(kind, gen)
        T = sum(ql)
        pool = KVPool(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                      torch.float32, "cpu")
        pool.kv.normal_(generator=gen)
        q = torch.randn(T, cfg.num_heads, cfg.head_dim, generator=gen)
        k = torch.randn(T, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        v = torch.randn(T, cfg.num_kv_heads, cfg.head_dim, generator=gen)
        metas = {n: b.build_metadata(ql, sl, tables, BLOCK_SIZE) for n, b in backends.items()}

        def attention(meta):          # one step: every layer's write + attention
            return lambda: [meta.backend.forward(q, k, v, meta, *pool.layer(i)) for i in range(cfg.num_layers)]

        attn = race({n: attention(m) for n, m in metas.items()}, rounds)
        build = race({n: (lambda b: lambda: b.build_metadata(ql, sl, tables, BLOCK_SIZE))(b)
                      for n, b in backends.items()}, rounds)
        ref_out = attention(metas["reference"])()[0]
        ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
        pos = torch.tensor([p for q_, s_ in zip(ql, sl) for p in range(s_ - q_, s_)])
        step_cands = {}
        for n in whole:
            b = backends[n]
            step_cands[n] = (lambda b: lambda: model(ids, pos, b.build_metadata(ql, sl, tables, BLOCK_SIZE), pool))(b)
        step = race(step_cands, rounds)
        logits = {n: model(ids, pos, backends[n].build_metadata(ql, sl, tables, BLOCK_SIZE), pool)
                  for n in step_cands}
        lines += [f"### {kind}: {sum(q_ == 1 for q_ in ql)} decodes"
                  + (f" + chunks of {ql[-2]} (fresh) and {ql[-1]} (after {sl[-1] - ql[-1]} cached)"
                     if kind == "mixed" else "") + f", {T} new tokens, {sum(sl)} context tokens", "",
                  "| backend | attention per step (4 layers), ms | vs reference | metadata build, ms "
                  "| max abs diff to reference (fp32) |",
                  "|---|---:|---:|---:|---:|"]
        for n, meta in metas.items():
            diff = (attention(meta)()[0] - ref_out).abs().max().item()
            lines.append(f"| {n} | {attn[n] * 1e3:.2f} | {attn['reference'] / attn[n]:.2f}x "
                         f"| {build[n] * 1e3:.2f} | {diff:.1e} |")
        lines += ["", "| whole-model step (metadata + forward), batch 64 | ms | attention share | vs reference |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {n} | {step[n] * 1e3:.2f} | {attn[n] / step[n]:.0%} | {step['reference'] / step[n]:.2f}x |"
                  for n in whole]
        lines += [""] + [f"{n}: same greedy tokens as the reference from the step logits (fp32): "
                         f"{torch.equal(logits['reference'].argmax(-1), logits[n].argmax(-1))}; max abs logit "
                         f"diff {(logits['reference'] - logits[n]).abs().max().item():.1e}." for n in whole[1:]] + [""]
    text = "\n".join(lines)
    if write:
        out = Path(__file__).with_suffix(".md")
        out.write_text("# Attention backends on this CPU\n\nWritten by `benchmarks/attention_backends.py "
                       "--write`; nothing here is typed by hand.\n\n" + text)
    return text


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="also write benchmarks/attention_backends.md")
    args = ap.parse_args()
    print(main(args.rounds, args.write, args.threads))
