"""Train the committed byte-level models ``tiny-py`` and ``tiny-py-draft``.

Random weights produce random bytes, and an acceptance rate measured on them
means nothing. This script trains two small Llama-shaped models on text every
Python installation already has, the standard library's own source, and writes
them as Hugging Face checkpoint folders that ``load_model`` reads:

* ``tiny-py``: exactly the shape of the built-in ``tiny`` preset (byte vocabulary
  of 260, hidden 256, 4 layers, 4 query heads, 2 KV heads, SwiGLU MLP 688).
* ``tiny-py-draft``: the same model cut to **one** layer, for speculative
  decoding. It shares the vocabulary, the tokenizer, the width and the KV layout
  (head_dim 64, 2 KV heads), so its cache blocks look like one layer of the
  target's. One layer because on a CPU a small model's step costs about the same
  per layer whatever its width (launch and Python overhead), so depth is what
  makes a draft cheap; the full width keeps it as good as one layer can be. One
  layer also cannot form induction heads (copying a span seen earlier needs two
  attention layers; Olsson et al., 2022), which is exactly what n-gram (prompt
  lookup) speculation does well: the two methods differ for a reason.

The training forward is our own :class:`~minibatch_engine.model.Transformer` on
a flat ragged batch with no cache (``AttentionMetadata.build(lens, lens)``,
``all_logits=True``): the weights are learned by the same code that serves them.

Corpus: the top-level ``*.py`` files of this interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, no sub-packages, so no test suite), sorted
by name; every 20th file is held out for validation. Each file becomes
``BOS + its UTF-8 bytes + EOS``. The text is the Python Software Foundation's,
under the PSF License Agreement; the weights are derived from it.

Everything is seeded (init, batch order); training runs for a fixed number of
steps, so a rerun on the same Python and torch gives the same numbers up to the
CPU's floating-point summation order. Matmuls run in bfloat16 under
``torch.autocast`` (weights, optimizer state and loss stay float32), which is
1.7x faster than float32 on a CPU with AVX512-BF16; validation is float32.
Weights are stored in bfloat16. Each model folder gets a ``README.md`` with the
measured time and losses, ``loss_curve.png`` and ``training_log.json``.

Reproduce (from the repository root; one CPU thread, about 12 minutes on an
idle machine of this project, more when it is shared)::

    PYTHONPATH=. python tools/train_tiny.py

``--readme-only`` rewrites the READMEs, curves and logs from the stored weights
and logs without training.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from minibatch_engine.attention import AttentionMetadata
from minibatch_engine.harness.bench import cpu_name
from minibatch_engine.model.config import BOS_ID, EOS_ID, PAD_ID, TINY, ModelConfig
from minibatch_engine.model.hf_export import hf_state_dict
from minibatch_engine.model.reference import reference_generate
from minibatch_engine.model.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "minibatch_engine" / "model" / "weights"
VAL_EVERY = 20          # every 20th stdlib file (sorted) is validation text
SHAPES = {
    "tiny-py": TINY.with_(name="tiny-py"),
    "tiny-py-draft": TINY.with_(name="tiny-py-draft", num_layers=1),
}


# --- corpus ------------------------------------------------------------------------

@dataclass
class Corpus:
    train: torch.Tensor        # [N] token ids (int64)
    val: torch.Tensor
    train_files: list[str]
    val_files: list[str]
    train_bytes: int
    val_bytes: int
    sha256: str                # of all files' bytes, in order (train then val)
    stdlib: str


def stdlib_corpus() -> Corpus:
    """The top-level ``*.py`` files of the standard library, sorted, split by index."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise SystemExit(f"no *.py files in the standard library folder {stdlib}")
    digest = hashlib.sha256()
    parts = {"train": ([], []), "val": ([], [])}
    for i, f in enumerate(files):
        data = f.read_bytes()
        digest.update(f.name.encode() + b"\0" + data)
        names, ids = parts["val" if i % VAL_EVERY == VAL_EVERY // 2 else "train"]
        names.append(f.name)
        ids.append(torch.tensor([BOS_ID, *data, EOS_ID], dtype=torch.long))
    (tn, tids), (vn, vids) = parts["train"], parts["val"]
    return Corpus(torch.cat(tids), torch.cat(vids), tn, vn,
                  sum(len(t) - 2 for t in tids), sum(len(t) - 2 for t in vids),
                  digest.hexdigest(), str(stdlib))


# --- model -------------------------------------------------------------------------

def init_for_training(model: Transformer, gen: torch.Generator, std: float = 0.02) -> Transformer:
    """GPT-2's initialisation: N(0, 0.02) everywhere, the two projections that write
    into the residual stream (``o_proj``, ``down_proj``) scaled by 1/sqrt(2 x layers)
    so the residual's variance does not grow with depth; norm gains 1."""
    resid_std = std / math.sqrt(2 * model.config.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                s = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)
    return model


def forward_logits(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """Every position's logits for ``B`` equal-length sequences ``x: [B, L]``, run
    as one flat ragged batch without a cache (the engine's full-recompute path)."""
    B, L = x.shape
    meta = AttentionMetadata.build([L] * B, [L] * B)
    positions = torch.arange(L).repeat(B)
    return model(x.reshape(-1), positions, meta, kv_pool=None, all_logits=True)


@torch.no_grad()
def evaluate(model: Transformer, windows: torch.Tensor) -> float:
    """Mean cross-entropy in bits per token (a token is a byte) over ``windows: [W, L+1]``."""
    model.eval()
    total = 0.0
    for chunk in windows.split(16):
        logits = forward_logits(model, chunk[:, :-1])
        total += F.cross_entropy(logits, chunk[:, 1:].reshape(-1), reduction="sum").item()
    model.train()
    return total / (windows.shape[0] * (windows.shape[1] - 1)) / math.log(2)


def val_windows(val: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """``count`` evenly spaced windows of ``seq_len + 1`` tokens over the validation text."""
    starts = torch.linspace(0, len(val) - seq_len - 2, count).long()
    return torch.stack([val[s:s + seq_len + 1] for s in starts])


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: ModelConfig, corpus: Corpus, args, seed: int) -> tuple[Transformer, dict]:
    gen = torch.Generator().manual_seed(seed)
    model = init_for_training(Transformer(cfg), gen).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    windows = val_windows(corpus.val, args.seq_len, args.val_windows)
    log = {"step": [], "train_bits": [], "val_step": [], "val_bits": []}
    steps, L, B = args.steps[cfg.name], args.seq_len, args.batch
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc=cfg.name, unit="step", dynamic_ncols=True)
    for step in bar:
        if step % args.eval_every == 0:
            log["val_step"].append(step)
            log["val_bits"].append(evaluate(model, windows))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, args.warmup)
        starts = torch.randint(0, len(corpus.train) - L - 1, (B,), generator=gen)
        batch = torch.stack([corpus.train[s:s + L + 1] for s in starts])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            logits = forward_logits(model, batch[:, :-1])
        loss = F.cross_entropy(logits.float(), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bits = loss.item() / math.log(2)
        log["step"].append(step)
        log["train_bits"].append(bits)
        bar.set_postfix(bits_per_byte=f"{bits:.3f}", val=f"{log['val_bits'][-1]:.3f}")
    log["train_seconds"] = time.perf_counter() - t0
    log["val_step"].append(steps)
    log["val_bits"].append(evaluate(model, windows))
    return model.eval(), log


# --- export: our names -> Hugging Face Llama names ----------------------------------

def hf_llama_config(cfg: ModelConfig, dtype_name: str) -> dict:
    """``config.json`` in the Hugging Face Llama layout (both the transformers 4.x and
    5.x spellings of the RoPE base and the dtype, so either version reads it)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "dtype": dtype_name, "torch_dtype": dtype_name,
    }


def byte_tokenizer_config() -> dict:
    """Tells :func:`minibatch_engine.model.load_tokenizer` to use the ByteTokenizer."""
    return {"minibatch_engine_tokenizer": "byte", "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def save_checkpoint(model: Transformer, folder: Path, dtype: torch.dtype, dtype_name: str) -> int:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in hf_state_dict(model).items()}
    save_file(tensors, folder / "model.safetensors",
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_llama_config(model.config, dtype_name),
                                                   indent=2) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(byte_tokenizer_config(), indent=2) + "\n")
    return (folder / "model.safetensors").stat().st_size


# --- reporting ---------------------------------------------------------------------

def plot_curve(log: dict, name: str, file: Path, seq_len: int, batch: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [s * seq_len * batch / 1e6 for s in log["step"]]
    k = 20                                         # running mean of the noisy train loss
    smooth = [sum(log["train_bits"][max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1))
              for i in range(len(tokens))]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(tokens, log["train_bits"], color="#1f77b4", alpha=0.25, lw=0.8)
    ax.plot(tokens, smooth, color="#1f77b4", label="train (running mean of 20 steps)")
    ax.plot([s * seq_len * batch / 1e6 for s in log["val_step"]], log["val_bits"], "o-",
            color="#d62728", ms=3, label="validation (held-out files)")
    ax.set(xlabel="training bytes seen (millions)", ylabel="bits per byte", title=name,
           ylim=(0, 8.5))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(file, dpi=110)
    plt.close(fig)


def sample(model: Transformer, prompt: str, n: int) -> str:
    """Greedy continuation of ``prompt`` (full recompute, as the correctness rule's
    reference), decoded as UTF-8 with special tokens dropped."""
    from minibatch_engine.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    out = reference_generate(model, tok.encode(prompt), n)
    if EOS_ID in out:
        out = out[:out.index(EOS_ID)]
    return prompt + tok.decode(out)


@torch.no_grad()
def beyond_context_bits(model: Transformer, corpus: Corpus, seq_len: int, count: int = 16) -> dict:
    """Validation bits per byte at positions inside and past the trained context, on
    windows twice as long as the training windows."""
    windows = val_windows(corpus.val, 2 * seq_len, count)
    logits = forward_logits(model, windows[:, :-1]).view(count, 2 * seq_len, -1)
    loss = F.cross_entropy(logits.transpose(1, 2), windows[:, 1:], reduction="none") / math.log(2)
    return {"val_bits_inside_context": loss[:, :seq_len].mean().item(),
            "val_bits_past_context": loss[:, seq_len:].mean().item()}


def compressor_bits(corpus: Corpus) -> dict[str, float]:
    """Bits per byte general-purpose compressors need on the validation files."""
    import lzma
    import zlib

    files = [Path(corpus.stdlib) / f for f in corpus.val_files]
    data = [f.read_bytes() for f in files]
    total = sum(len(d) for d in data)
    return {"zlib_bits": 8 * sum(len(zlib.compress(d, 9)) for d in data) / total,
            "lzma_bits": 8 * sum(len(lzma.compress(d, preset=9)) for d in data) / total}


@torch.no_grad()
def sample_with_temperature(model: Transformer, prompt: str, n: int, temperature: float = 0.8,
                            seed: int = 0) -> str:
    """A seeded sampled continuation (full recompute), to show what greedy's loops hide."""
    from minibatch_engine.model.reference import full_forward_logits
    from minibatch_engine.model.tokenizer import ByteTokenizer

    tok, gen = ByteTokenizer(), torch.Generator().manual_seed(seed)
    ids = tok.encode(prompt)
    out: list[int] = []
    for _ in range(n):
        probs = torch.softmax(full_forward_logits(model, ids + out)[-1] / temperature, dim=-1)
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        if nxt == EOS_ID:
            break
        out.append(nxt)
    return prompt + tok.decode(out)


def write_readme(folder: Path, name: str, cfg: ModelConfig, info: dict, corpus: Corpus,
                 args, command: str) -> None:
    fence = "```"
    other = "tiny-py" if name == "tiny-py-draft" else "tiny-py-draft"
    role = ("the draft model for speculative decoding with `tiny-py`: the same model cut to "
            "one layer" if name == "tiny-py-draft" else
            "a byte-level Llama with the shape of the built-in `tiny` preset")
    samples = "\n\n".join(f"{fence}python\n{s}\n{fence}" for s in info["samples"])
    sampled = "\n\n".join(f"{fence}python\n{s}\n{fence}" for s in info["sampled"])
    text = f"""# {name}

`{name}` is {role}, trained on Python source code so that its output is
readable and speculative-decoding acceptance rates mean something. Its sibling is
`{other}`. Written by `tools/train_tiny.py`; do not edit by hand.

Load it with `minibatch_engine.model.load_model(trained_model_path("{name}"))`
and `load_tokenizer(...)` on the same folder (which returns the byte tokenizer).

## Shape

| | |
|---|---|
| family | Llama (RMSNorm, RoPE theta {cfg.rope_theta:g}, grouped-query attention, SwiGLU) |
| vocabulary | {cfg.vocab_size} (256 bytes, BOS {BOS_ID}, EOS {EOS_ID}, PAD {PAD_ID}, one unused id) |
| hidden size | {cfg.hidden_size} |
| layers | {cfg.num_layers} |
| heads / KV heads / head dim | {cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim} |
| MLP (intermediate) size | {cfg.intermediate_size} |
| parameters | {info['params']:,} ({info['params_no_embed']:,} without the embedding and output matrices) |
| trained context | {args.seq_len} bytes. `max_position_embeddings` is {cfg.max_position}, the `tiny` preset's, but positions past {args.seq_len} were never trained: on {2 * args.seq_len}-byte validation windows the loss is {info['val_bits_inside_context']:.2f} bits per byte at positions below {args.seq_len} and {info['val_bits_past_context']:.2f} past it. Keep prompt + output within {args.seq_len} tokens for meaningful text. |
| weights | `model.safetensors`, bfloat16, {info['file_bytes']:,} bytes; Hugging Face `LlamaForCausalLM` names |
| tokenizer | byte-level: `tokenizer_config.json` says `"minibatch_engine_tokenizer": "byte"` |

## Corpus

The standard library source of Python {platform.python_version()}: the
{len(corpus.train_files) + len(corpus.val_files)} top-level `*.py` files of
`{corpus.stdlib}` (no sub-packages), sorted by name. Every {VAL_EVERY}th file
({len(corpus.val_files)} files, {corpus.val_bytes:,} bytes: {', '.join(corpus.val_files)}) is
held out for validation; the other {len(corpus.train_files)} files
({corpus.train_bytes:,} bytes) are training text. SHA-256 of the files (name, NUL,
bytes, in sorted order): `{corpus.sha256}`. Each file is `BOS + UTF-8 bytes + EOS`.

The text is Python's, copyright the Python Software Foundation, under the PSF
License Agreement (https://docs.python.org/3/license.html); these weights are
derived from it.

## Training

Our own `Transformer` forward (flat ragged batch, no cache, every position's
logits), AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), peak learning
rate {args.lr:g} with {args.warmup} warm-up steps and cosine decay to a tenth,
gradient clipping 1.0, {info['steps']} steps of {args.batch} random windows of
{args.seq_len} bytes ({info['steps'] * args.batch * args.seq_len / 1e6:.2f} M bytes seen,
{info['steps'] * args.batch * args.seq_len / corpus.train_bytes:.2f} passes over the
training text), seed {info['seed']}, precision {info['precision']} (validation always in
float32), torch {torch.__version__}, {info['threads']} CPU thread(s).

Training time on the machine that produced the committed weights:
**{info['train_seconds'] / 60:.1f} minutes** of wall clock ({info['cpu']}, 2 cores shared
with other jobs at the time, so an unloaded machine is faster).

| | bits per byte |
|---|---|
| final train loss (mean of the last 20 steps) | {info['final_train_bits']:.3f} |
| final validation loss, float32 | {info['final_val_bits']:.3f} |
| final validation loss, the stored bfloat16 weights | {info['final_val_bits_bf16']:.3f} |

The validation loss is measured on {args.val_windows} evenly spaced
{args.seq_len}-byte windows of the held-out files. For scale: a uniform guess over
bytes costs 8 bits per byte; on the same held-out files, compressed one by one
(each sees its whole file, not {args.seq_len} bytes), zlib at level 9 needs
{info['zlib_bits']:.2f} and xz (LZMA, preset 9) {info['lzma_bits']:.2f} bits per byte.

![loss curve](loss_curve.png)

## Greedy samples (stored weights, float32, full recompute)

{samples}

Greedy decoding of a small byte-level model falls into loops (``____``, repeated
phrases) within a line or two. Sampling (temperature 0.8, seed 0, float32) shows
more of what it learned:

{sampled}

## Reproduce

{fence}
{command}
{fence}

The numbers above depend on the Python version (the corpus) and, in their last
digits, on the CPU and torch build.
"""
    (folder / "README.md").write_text(text)


LOG_KEYS = ("step", "train_bits", "val_step", "val_bits", "train_seconds", "seed", "cpu", "threads",
            "precision")


def report(name: str, cfg: ModelConfig, folder: Path, log: dict, corpus: Corpus, args,
           command: str) -> dict:
    """Measure the stored checkpoint and write its loss curve, log and README."""
    from minibatch_engine.model.loader import load_model

    stored = load_model(folder, device="cpu", dtype="float32")
    windows = val_windows(corpus.val, args.seq_len, args.val_windows)
    info = {
        "params": sum(p.numel() for p in stored.parameters()),
        "params_no_embed": sum(p.numel() for n, p in stored.named_parameters()
                               if n not in ("embed.weight", "lm_head.weight")),
        "file_bytes": (folder / "model.safetensors").stat().st_size,
        "steps": len(log["step"]),
        "final_train_bits": sum(log["train_bits"][-20:]) / len(log["train_bits"][-20:]),
        "final_val_bits": log["val_bits"][-1],
        "final_val_bits_bf16": evaluate(stored, windows),
        **{k: log[k] for k in ("train_seconds", "seed", "cpu", "threads", "precision")},
        **compressor_bits(corpus),
        **beyond_context_bits(stored, corpus, args.seq_len),
    }
    samples = [sample(stored, prompt, args.sample_tokens)
               for prompt in ("def ", "import ", "class Parser:\n    def __init__(self")]
    sampled = [sample_with_temperature(stored, prompt, args.sample_tokens)
               for prompt in ("def ", "import ")]
    plot_curve(log, name, folder / "loss_curve.png", args.seq_len, args.batch)
    (folder / "training_log.json").write_text(json.dumps({**info, **log}) + "\n")
    write_readme(folder, name, cfg, {**info, "samples": samples, "sampled": sampled}, corpus, args,
                 command)
    print(f"{name}: {json.dumps(info)}\n--- sample ---\n{samples[0]}\n")
    return info


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for tiny-py/ and tiny-py-draft/")
    p.add_argument("--target-steps", type=int, default=700)
    p.add_argument("--draft-steps", type=int, default=700)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", choices=("bf16-mixed", "fp32"), default="bf16-mixed",
                   help="bf16-mixed: matmuls in bfloat16 under torch.autocast, weights, optimizer "
                        "and loss in float32 (1.7x faster on a CPU with AVX512-BF16); fp32: all float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-tokens", type=int, default=160)
    p.add_argument("--readme-only", action="store_true",
                   help="do not train: rewrite README.md, loss_curve.png and training_log.json "
                        "from the stored weights and the training log already in --out")
    args = p.parse_args(argv)
    args.steps = {"tiny-py": args.target_steps, "tiny-py-draft": args.draft_steps}
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    corpus = stdlib_corpus()
    print(f"corpus: {len(corpus.train_files)} train files ({corpus.train_bytes:,} bytes), "
          f"{len(corpus.val_files)} validation files ({corpus.val_bytes:,} bytes) from {corpus.stdlib}")
    flags = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--readme-only"]
    command = " ".join(["PYTHONPATH=. python tools/train_tiny.py", *flags])
    for k, (name, cfg) in enumerate(SHAPES.items()):
        folder = args.out / name
        if args.readme_only:
            saved = json.loads((folder / "training_log.json").read_text())
            log = {key: saved.get(key) for key in LOG_KEYS}
            log["threads"] = log["threads"] or args.threads
            log["precision"] = log["precision"] or "fp32"
        else:
            model, log = train(cfg, corpus, args, seed=args.seed + k)
            log.update(seed=args.seed + k, cpu=cpu_name(), threads=args.threads,
                       precision=args.precision)
            save_checkpoint(model, folder, torch.bfloat16, "bfloat16")
        report(name, cfg, folder, log, corpus, args, command)


if __name__ == "__main__":
    main()
