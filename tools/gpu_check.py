"""``make gpu-check``: the CUDA tests and a few measurements, written to gpu_check.json.

Run on a machine with an NVIDIA GPU (under 5 minutes on an H100/H200), with any
Python that has a CUDA build of torch (the package is imported from this
checkout; nothing is installed):

    python tools/gpu_check.py [--out gpu_check.json] [--skip-tests]

1. every test marked ``cuda`` or ``triton`` (``pytest -m "cuda or triton"``: the
   Triton kernel's tests then run compiled, on the GPU), with pass/fail/skip
   counts (the whole test run is stopped after ``TEST_TIMEOUT_S``);
2. the Triton kernel against the reference on a random paged batch in bfloat16
   (decodes and a prefill chunk, GQA), the dtype the measurements below use;
3. decode throughput of ``llama-3.2-1b`` (Llama-3.2-1B's shape, random weights,
   bf16, the triton backend) through the engine at batch 1, 32 and 256, with CUDA
   graphs on and off; each decode step's bytes (weights + KV read + KV written)
   come from the roofline cost model's formula (:mod:`minibatch_engine.sim`), so
   achieved HBM bandwidth = bytes / measured step time, and its share of the
   GPU's peak when the GPU is one the simulator knows;
4. prefill tokens/s and MFU (model FLOPs from the same formula / time / peak).

Everything in the JSON is measured or read from the machine (GPU name, driver,
versions, date, git commit); nothing is typed in. The file is written after
every part, and a part that fails records its error instead of stopping the
rest. Without CUDA it exits with status 2 and says so.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    import torch  # noqa: E402
except ImportError:
    sys.exit(f"error: torch is not installed for {sys.executable}; use a Python with a CUDA build of "
             "torch (make install, or pip install torch)")

MODEL = "llama-3.2-1b"
CONTEXT = 512          # prompt tokens of every decode request
DECODE_STEPS = 64      # output tokens per decode request
PREFILL = (8, 2048)    # prompts x tokens in one prefill step
TEST_TIMEOUT_S = 240   # the whole pytest run of the CUDA tests


def detect_gpu(name: str):
    """The simulator's GPU whose name appears in the CUDA device name, or None."""
    from minibatch_engine.sim import GPUS
    key = name.lower().replace(" ", "")
    for tag, gpu in (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb")):
        if tag in key:
            return GPUS[gpu]
    return None


def machine() -> dict:
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_bytes": props.total_memory,
        "compute_capability": f"{props.major}.{props.minor}",
        "driver": run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "cuda_runtime": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": run(["git", "rev-parse", "HEAD"]),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
    }


def cuda_tests() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                                   "cuda or triton", "tests", f"--junitxml={xml}"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            tail = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return {"timed_out_after_s": TEST_TIMEOUT_S, "exit_code": None, "output_tail": tail[-3000:]}
        seconds = time.perf_counter() - t0
        print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if xml.exists():
            for suite in ET.parse(xml).getroot().iter("testsuite"):
                for k in counts:
                    counts[k] += int(suite.get(k, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts.update(exit_code=proc.returncode, seconds=round(seconds, 1))
    return counts


def decode_engine(model, batch: int, graphs: bool, **sim):
    """The engine and requests of one decode measurement (``model=None`` and
    ``sim``: the same schedule on the simulator, for the unit tests)."""
    from minibatch_engine.core.engine import Engine
    from minibatch_engine.sampling.params import SamplingParams
    eng = Engine(model, max_num_seqs=batch, max_model_len=CONTEXT + DECODE_STEPS + 16,
                 attention_backend="triton", cuda_graphs=graphs,
                 max_num_batched_tokens=max(2048, CONTEXT * min(batch, 16)), **sim)
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(0, 32000, (CONTEXT,), generator=gen).tolist()
        eng.add_request(prompt, SamplingParams(max_tokens=DECODE_STEPS, ignore_eos=True))
    return eng


def steady_decode_steps(eng, batch: int) -> list:
    """The decode steps with every request decoding, the first four dropped (graph
    capture, allocator warm-up)."""
    steps = [s for s in eng.trace.steps if s.prefill_tokens == 0 and s.decode_tokens == batch]
    return steps[4:] or steps


def decode_run(model, batch: int, graphs: bool, cost, peak_bw) -> dict:
    """``batch`` requests of CONTEXT prompt tokens decode DECODE_STEPS tokens;
    the steady decode steps (every request decoding) are timed from the trace."""
    eng = decode_engine(model, batch, graphs)
    eng.run()
    steps = steady_decode_steps(eng, batch)
    step_s = sorted(s.wall_end - s.wall_start for s in steps)[len(steps) // 2]   # median
    ctx = CONTEXT + DECODE_STEPS // 2      # mean context over the decode
    c = cost.step_cost([(1, ctx)] * batch)
    out = {"batch": batch, "cuda_graphs": graphs, "decode_steps_timed": len(steps),
           "median_step_ms": step_s * 1e3, "output_tokens_per_s": batch / step_s,
           "bytes_per_step": c.bytes, "achieved_GBps": c.bytes / step_s / 1e9}
    if peak_bw:
        out["hbm_roofline_fraction"] = c.bytes / step_s / peak_bw
    if graphs:
        out["graph_replays"] = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
    return out


def prefill_engine(model, **sim):
    """The engine and requests of one prefill measurement: PREFILL's prompts, all
    in the first step. No watermark: the pool holds exactly the prompts (and a
    little), and a watermark of 1% of it would hold one prompt back."""
    from minibatch_engine.core.engine import Engine
    from minibatch_engine.sampling.params import SamplingParams
    n, L = PREFILL
    eng = Engine(model, max_num_seqs=n, max_model_len=L + 8, attention_backend="triton", watermark=0.0,
                 max_num_batched_tokens=n * L, enable_prefix_caching=False, **sim)
    for i in range(n):
        eng.add_request([(7 * i + j) % 32000 for j in range(L)], SamplingParams(max_tokens=1, ignore_eos=True))
    return eng


def prefill_run(model, cost, peak_flops) -> dict:
    n, L = PREFILL
    times = []
    for _ in range(3):                     # the first is a warm-up
        eng = prefill_engine(model)
        eng.run()
        first = eng.trace.steps[0]
        if first.prefill_tokens != n * L:
            raise RuntimeError(f"the prefill ran in several steps ({first.prefill_tokens} tokens in the first)")
        times.append(first.wall_end - first.wall_start)
    t = min(times[1:])
    flops = cost.step_cost([(L, L)] * n).flops
    out = {"prompts": n, "prompt_tokens": L, "step_ms": t * 1e3, "prefill_tokens_per_s": n * L / t,
           "model_TFLOPs_per_s": flops / t / 1e12}
    if peak_flops:
        out["mfu"] = flops / t / peak_flops
    return out


@torch.no_grad()
def triton_check(dtype=torch.bfloat16, device: str = "cuda", seed: int = 0) -> dict:
    """The Triton kernel in ``dtype`` against the reference (in float32, on the same
    inputs rounded to bfloat16) on a random paged batch: three decodes and a
    24-token chunk after 40 cached tokens, 8 query heads on 2 KV heads, blocks of
    16 in shuffled order. Returns the largest absolute difference and whether it
    is within ``atol`` (bfloat16 keeps about 3 significant digits). The unit
    tests run it in float32 through Triton's interpreter, whose ``tl.dot`` gives
    wrong results for bfloat16 inputs (triton 3.9); on the GPU it runs in
    bfloat16, the dtype measured below."""
    from minibatch_engine.attention import get_attention_backend
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs, atol = 8, 2, 64, 16, 3e-2
    query_lens, seq_lens = [1, 1, 1, 24], [37, 130, 5, 64]
    need = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(need) + 4                     # a few blocks no sequence uses
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, k0 = [], 0
    for n in need:
        tables.append(order[k0:k0 + n])
        k0 += n
    q, k, v = (torch.randn(sum(query_lens), h, d, generator=g) for h in (hq, hkv, hkv))
    k_pool, v_pool = (torch.randn(num_blocks * bs, hkv, d, generator=g) for _ in "kv")
    outs = {}
    for name, run_dtype in (("triton", dtype), ("reference", torch.float32)):
        backend = get_attention_backend(name, device)
        meta = backend.build_metadata(query_lens, seq_lens, tables, bs, device=device)
        cast = [x.to(device, torch.bfloat16).to(run_dtype) for x in (q, k, v, k_pool, v_pool)]
        outs[name] = backend.forward(*cast[:3], meta, *cast[3:]).float()
    err = (outs["triton"] - outs["reference"]).abs().max().item()
    return {"dtype": str(dtype).removeprefix("torch."), "max_abs_error": err, "atol": atol, "ok": err <= atol,
            "case": {"query_lens": query_lens, "seq_lens": seq_lens, "heads": [hq, hkv], "head_dim": d,
                     "block_size": bs}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "gpu_check.json"))
    ap.add_argument("--skip-tests", action="store_true", help="measurements only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: make gpu-check needs a CUDA GPU (torch.cuda.is_available() is False; "
              f"torch {torch.__version__}). Run it on a machine with an NVIDIA GPU and a CUDA build of torch.",
              file=sys.stderr)
        return 2
    from minibatch_engine import build_model
    from minibatch_engine.model.config import get_preset
    from minibatch_engine.sim import RooflineCostModel
    t_start = time.perf_counter()
    info = machine()
    gpu = detect_gpu(info["gpu"])
    report = {"machine": info,
              "roofline_gpu": None if gpu is None else {"name": gpu.name, "peak_flops": gpu.peak_flops,
                                                        "hbm_bandwidth": gpu.hbm_bandwidth, "source": gpu.source}}
    out = Path(args.out)

    def attempt(fn, **labels) -> dict:
        """A part's result, or its error: a failed part must not lose the others."""
        try:
            return fn()
        except Exception as e:
            return {**labels, "error": f"{type(e).__name__}: {e}"}

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - t_start, 1)
        out.write_text(json.dumps(report, indent=2) + "\n")

    def part(name, fn):
        report[name] = attempt(fn)
        print(f"{name}:", report[name])
        save()

    if not args.skip_tests:
        part("cuda_tests", cuda_tests)
    part("triton_check", triton_check)
    cfg = get_preset(MODEL)
    model = build_model(cfg, device="cuda", dtype="bfloat16")
    cost = RooflineCostModel(gpu, cfg, step_overhead_s=0.0) if gpu else RooflineCostModel(
        _unknown_gpu(), cfg, step_overhead_s=0.0)
    report["model"] = {"preset": MODEL, "parameters": cfg.num_parameters(), "dtype": "bfloat16",
                       "weights": "random (seeded)", "attention_backend": "triton",
                       "decode_context_tokens": CONTEXT, "decode_output_tokens": DECODE_STEPS}
    report["decode"] = []
    for batch in (1, 32, 256):
        for graphs in (True, False):
            r = attempt(lambda: decode_run(model, batch, graphs, cost, gpu.hbm_bandwidth if gpu else None),
                        batch=batch, cuda_graphs=graphs)
            print("decode:", r)
            report["decode"].append(r)
            save()
    part("prefill", lambda: prefill_run(model, cost, gpu.peak_flops if gpu else None))
    print(f"wrote {out} ({report['seconds']} s)")
    tests = report.get("cuda_tests", {})
    failed = (not report["triton_check"].get("ok")
              or any("error" in r for r in report["decode"]) or "error" in report["prefill"]
              or tests.get("failures") or tests.get("errors") or tests.get("exit_code", 0) not in (0, 5))
    return 1 if failed else 0


def _unknown_gpu():
    """A GPU record used only for byte and FLOP counts (which do not depend on it)."""
    from minibatch_engine.sim.hardware import GPU
    return GPU("unknown", 1.0, 1.0, 0.0, 1.0, "placeholder: only the formula's counts are used")


if __name__ == "__main__":
    sys.exit(main())
