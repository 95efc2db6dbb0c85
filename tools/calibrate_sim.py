#!/usr/bin/env python3
"""Fit the simulator's per-operator constants on measured GPU timings.

    python tools/calibrate_sim.py                 # writes minibatch_engine/sim/calibration.json
    python tools/calibrate_sim.py --check         # refits and compares with the committed file

Data: ``data/gpu-profiles/`` (CUDA-timed layers from the Vidur project, MIT
licence; see its README): per (tokens, tensor-parallel degree) the median time
of each operator of one layer, on H100 and A100, for Llama-2-7B and phi-2
shapes; all-reduce times on an 8x H100 NVLink machine; and point-to-point
send/recv times between two H100s, within a node and across two nodes.

What is fitted, with the formulas of ``minibatch_engine/sim/operators.py``
(the engine's own code, so the fit and the simulator cannot drift apart):

* projections: four constants shared by every GPU and shape (``e_compute``,
  ``e_memory``, ``p``, ``t0_s``);
* memory-bound operators: per operator an efficiency and a fixed time, shared
  by the GPUs, and a pooled pair for operators never measured;
* all-reduce: per GPU count a fixed time and a bus bandwidth, stored as a
  fraction of the measured machine's NVLink bandwidth so other GPUs scale;
* send/recv (the pipeline-parallel hand-over): a fixed time and a bandwidth
  within a node (a fraction of NVLink, like the all-reduce) and across nodes
  (bytes/s of the network between two GPUs: not a GPU property).

Criterion: the mean pseudo-Huber loss of log(predicted / measured) with a 5%
knee: each row counts by its relative error, and the +-30% jumps where the
GEMM library switches kernels do not drag the fit. Minimised by Nelder-Mead
on the parameters' logarithms (numpy only). The script also measures the
model on data it was not fitted on: fitted on H100 alone and checked on
A100 (and the reverse), fitted on Llama-2-7B alone and checked on phi-2.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minibatch_engine.model.config import ModelConfig  # noqa: E402
from minibatch_engine.sim import operators as ops  # noqa: E402
from minibatch_engine.sim.calibration import CALIBRATION_FILE, Calibration  # noqa: E402
from minibatch_engine.sim.hardware import get_gpu  # noqa: E402

DATA = ROOT / "data" / "gpu-profiles"
GPU_DIRS = {"a100": "A100-80GB", "h100": "H100-SXM"}     # data folder -> the simulator's GPU preset
ALL_REDUCE_GPU = {"h100_dgx": "H100-SXM"}                 # the machine the all-reduce file was measured on
SMALL_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add", "emb")
KNEE = 0.05


# --- data ---------------------------------------------------------------------------------
def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def shape_of(row: dict, name: str) -> ModelConfig:
    """The profiled layer's shape as a ModelConfig (only the fields the operators read)."""
    gated = row["use_gated_mlp"].strip().lower() == "true"
    return ModelConfig(family="llama" if gated else "gpt2", vocab_size=int(row["vocab_size"]),
                       hidden_size=int(row["n_embd"]), num_layers=1, num_heads=int(row["n_head"]),
                       num_kv_heads=int(row["n_kv_head"]), intermediate_size=int(row["n_expanded_embd"]),
                       max_position=4096, name=name)


def load_compute(data: Path):
    """Long tables of the projections' and the small operators' measured rows."""
    gemm, small = [], []
    for folder, gpu_name in GPU_DIRS.items():
        gpu = get_gpu(gpu_name)
        for path in sorted((data / "compute" / folder).glob("*.csv")):
            name = path.name.split(".")[0]
            for row in read_csv(path):
                model, M, tp = shape_of(row, name), int(row["num_tokens"]), int(row["num_tensor_parallel_workers"])
                for op in ops.PROJECTIONS + SMALL_OPS:
                    value = row.get(f"time_stats.{op}.median", "")
                    if value in ("", "nan"):
                        continue          # phi-2 has no post_attention_layernorm (a parallel block)
                    y = float(value) * 1e-3
                    base = dict(gpu=folder, model=name, op=op, tp=tp, M=M, y=y,
                                peak=gpu.peak_flops, bw=gpu.hbm_bandwidth)
                    if op in ops.PROJECTIONS:
                        K, N = ops.projection_shape(op, model, tp)
                        gemm.append(dict(base, K=K, N=N))
                    else:
                        small.append(dict(base, bytes=ops.small_op_bytes(op, model, M, tp)))
    return table(gemm), table(small)


def load_all_reduce(data: Path):
    rows = []
    for folder, gpu_name in ALL_REDUCE_GPU.items():
        for row in read_csv(data / "network" / folder / "all_reduce.csv"):
            rows.append(dict(n=int(row["num_workers"]), size=float(row["size"]),
                             y=float(row["time_stats.all_reduce.median"]) * 1e-3,
                             link=get_gpu(gpu_name).nvlink_bandwidth))
    return table(rows)


def load_send_recv(data: Path):
    """Point-to-point rows: ``devices_per_node`` 2 = both GPUs in one node, 1 = across nodes."""
    rows = []
    for folder, gpu_name in ALL_REDUCE_GPU.items():
        for row in read_csv(data / "network" / folder / "send_recv.csv"):
            rows.append(dict(across=int(row["devices_per_node"]) == 1, size=float(row["size"]),
                             y=float(row["time_stats.send_recv.median"]) * 1e-3,
                             link=get_gpu(gpu_name).nvlink_bandwidth))
    return table(rows)


def table(rows: list[dict]) -> SimpleNamespace:
    return SimpleNamespace(**{k: np.array([r[k] for r in rows]) for k in rows[0]})


# --- fitting --------------------------------------------------------------------------------
def loss(pred, meas) -> float:
    r = np.log(pred / meas) / KNEE
    return float(np.mean(np.sqrt(1 + r * r) - 1))


def nelder_mead(f, x0, step: float, iters: int = 2000, tol: float = 1e-10):
    """Plain Nelder-Mead: reflect, expand, contract, shrink."""
    simplex = [np.asarray(x0, float)] + [np.asarray(x0, float) + step * e for e in np.eye(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centre = np.mean(simplex[:-1], axis=0)
        xr = 2 * centre - simplex[-1]
        fr = f(xr)
        if fr < values[0]:
            xe = 3 * centre - 2 * simplex[-1]
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = (centre + simplex[-1]) / 2
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                simplex = [simplex[0]] + [(simplex[0] + x) / 2 for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def fit_positive(objective, x0) -> np.ndarray:
    """Minimise over positive parameters (their logs), then polish twice with smaller steps."""
    g = lambda z: objective(np.exp(z))  # noqa: E731
    z = nelder_mead(g, np.log(x0), 0.3)
    for step in (0.1, 0.05):
        z = nelder_mead(g, z, step)
    return np.exp(z)


def cal_of(x) -> Calibration:
    e_c, e_m, p, t0 = map(float, x)
    return Calibration(e_compute=e_c, e_memory=e_m, p=p, t0_s=t0, small_ops={}, all_reduce={})


def predict_gemm(G, mask, cal: Calibration):
    gpu = SimpleNamespace(peak_flops=G.peak[mask], hbm_bandwidth=G.bw[mask])
    return ops.gemm_time(G.M[mask], G.N[mask], G.K[mask], gpu, cal)


def ideal_gemm(G):
    """max(FLOPs / peak, bytes / bandwidth): the roofline with nothing fitted."""
    return np.maximum(2 * G.M * G.N * G.K / G.peak, 2 * (G.M * G.K + G.K * G.N + G.M * G.N) / G.bw)


def fit_gemm(G, mask) -> Calibration:
    def objective(x):
        return 1e9 if x[2] < 1 else loss(predict_gemm(G, mask, cal_of(x)), G.y[mask])   # p >= 1: >= the max
    return cal_of(fit_positive(objective, (0.7, 0.85, 1.5, 5e-6)))


def fit_small(S, mask) -> tuple[float, float]:
    e, t0 = fit_positive(lambda x: loss(S.bytes[mask] / (S.bw[mask] * x[0]) + x[1], S.y[mask]), (0.5, 3e-6))
    return float(e), float(t0)


def fit_all_reduce(A, mask) -> tuple[float, float]:
    traffic = 2 * (A.n[mask] - 1) / A.n[mask] * A.size[mask]
    # scaled parameters: microseconds, and the fraction of the link bandwidth
    a, frac = fit_positive(lambda x: loss(x[0] * 1e-6 + traffic / (x[1] * A.link[mask]), A.y[mask]), (20.0, 0.5))
    return float(a * 1e-6), float(frac)


def fit_send_recv(P, mask) -> tuple[float, float]:
    """(alpha seconds, bandwidth in bytes/s) of ``alpha + bytes / bandwidth``."""
    a, gbps = fit_positive(lambda x: loss(x[0] * 1e-6 + P.size[mask] / (x[1] * 1e9), P.y[mask]), (10.0, 50.0))
    return float(a * 1e-6), float(gbps * 1e9)


def errors(pred, meas) -> dict:
    e = np.abs(pred / meas - 1)
    return {"rows": int(e.size), "median": round(float(np.median(e)), 4),
            "p90": round(float(np.percentile(e, 90)), 4), "max": round(float(e.max()), 4)}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- main ----------------------------------------------------------------------------------
def calibrate(data: Path) -> dict:
    G, S = load_compute(data)
    A = load_all_reduce(data)
    every = np.ones(G.y.size, bool)
    h100, a100 = G.gpu == "h100", G.gpu == "a100"
    llama, phi = G.model == "Llama-2-7b-hf", G.model == "phi-2"
    cal = fit_gemm(G, every)
    held_out = {  # name: (fitted on, checked on)
        "fitted on H100, checked on A100": (h100, a100),
        "fitted on A100, checked on H100": (a100, h100),
        "fitted on Llama-2-7B (H100), checked on phi-2 (H100)": (h100 & llama, phi),
    }
    projections = {"calibration set": errors(predict_gemm(G, every, cal), G.y),
                   "ideal roofline (no constant fitted)": errors(ideal_gemm(G), G.y)}
    for name, (train, test) in held_out.items():
        projections[name] = errors(predict_gemm(G, test, fit_gemm(G, train)), G.y[test])
    per_op = {f"{gpu} {model} {op}": errors(predict_gemm(G, m, cal), G.y[m])
              for gpu in ("h100", "a100") for model in ("Llama-2-7b-hf", "phi-2") for op in ops.PROJECTIONS
              if (m := (G.gpu == gpu) & (G.model == model) & (G.op == op)).any()}

    small = {op: fit_small(S, S.op == op) for op in SMALL_OPS}
    small["generic"] = fit_small(S, S.op != "emb")
    small_errors = {}
    for op in SMALL_OPS:
        m = S.op == op
        e, t0 = small[op]
        small_errors[op] = errors(S.bytes[m] / (S.bw[m] * e) + t0, S.y[m])
        test = m & (S.gpu == "a100")
        e, t0 = fit_small(S, m & (S.gpu == "h100"))
        small_errors[f"{op}, fitted on H100, checked on A100"] = errors(S.bytes[test] / (S.bw[test] * e) + t0,
                                                                      S.y[test])

    per_count = {int(n): fit_all_reduce(A, A.n == n) for n in sorted(set(A.n.tolist()))}
    shared = fit_all_reduce(A, np.ones(A.y.size, bool))
    ar_errors = {}
    for n, (alpha, frac) in per_count.items():
        for label, lo, hi in (("under 1 MiB", 0, 2**20), ("1-8 MiB", 2**20, 2**23), ("8 MiB and more", 2**23, np.inf)):
            m = (A.n == n) & (A.size >= lo) & (A.size < hi)
            traffic = 2 * (n - 1) / n * A.size[m]
            ar_errors[f"{n} GPUs, {label}"] = errors(alpha + traffic / (frac * A.link[m]), A.y[m])

    P = load_send_recv(data)
    within, across = fit_send_recv(P, ~P.across), fit_send_recv(P, P.across)
    link = float(P.link[0])
    sr_errors = {}
    for name, mask, (alpha, bw) in (("within a node", ~P.across, within), ("across nodes", P.across, across)):
        for label, lo, hi in (("under 1 MiB", 0, 2**20), ("1-8 MiB", 2**20, 2**23), ("8 MiB and more", 2**23, np.inf)):
            m = mask & (P.size >= lo) & (P.size < hi)
            sr_errors[f"{name}, {label}"] = errors(alpha + P.size[m] / bw, P.y[m])

    readme = (data / "README.md").read_text()
    commit = re.search(r"commit\s+`?([0-9a-f]{7,40})`?", readme)
    files = sorted(p for p in data.rglob("*.csv"))
    return {
        "model_form": "per-operator smooth roofline (minibatch_engine/sim/operators.py)",
        "gemm": {"e_compute": cal.e_compute, "e_memory": cal.e_memory, "p": cal.p, "t0_s": cal.t0_s},
        "small_ops": {op: {"e": e, "t0_s": t0} for op, (e, t0) in small.items()},
        "all_reduce": {
            "per_gpu_count": {str(n): {"alpha_s": a, "busbw_fraction": f} for n, (a, f) in per_count.items()},
            "shared": {"alpha_s": shared[0], "busbw_fraction": shared[1]},
            "measured_on": "8x H100-SXM (DGX, NVLink 450 GB/s each direction); busbw_fraction is of that",
        },
        "send_recv": {
            "within_node": {"alpha_s": within[0], "bandwidth_fraction": within[1] / link},
            "across_nodes": {"alpha_s": across[0], "bandwidth_Bps": across[1]},
            "measured_on": "2 H100-SXM (DGX): in one node over NVLink (bandwidth_fraction is of 450 GB/s) "
                           "and in two nodes over the network (bandwidth_Bps, bytes/s)",
        },
        "errors": {"projections": projections, "projections by file and operator": per_op,
                   "small operators": small_errors, "all-reduce": ar_errors, "send/recv": sr_errors},
        "provenance": {
            "data": "data/gpu-profiles: microsoft/vidur data/profiling, MIT licence (LICENSE.vidur)",
            "data_commit": commit.group(1) if commit else None,
            "files": {str(p.relative_to(data)): sha256(p) for p in files},
            "fit": f"mean pseudo-Huber of log(predicted/measured), knee {KNEE}; Nelder-Mead on log-parameters",
            "script": "tools/calibrate_sim.py",
            "numpy": np.__version__,
            "date": datetime.date.today().isoformat(),
        },
    }


def fitted_constants(result: dict) -> dict:
    return {k: result[k] for k in ("gemm", "small_ops", "all_reduce", "send_recv")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help="the gpu-profiles folder (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=CALIBRATION_FILE, help="where to write (default: %(default)s)")
    ap.add_argument("--check", action="store_true",
                    help="refit and compare with --out (relative tolerance 1e-3); write nothing")
    args = ap.parse_args(argv)
    result = calibrate(args.data)
    if args.check:
        stored = fitted_constants(json.loads(args.out.read_text()))
        ok = np.allclose(flatten(stored), flatten(fitted_constants(result)), rtol=1e-3, atol=0)
        print("the committed constants reproduce" if ok else "the committed constants do NOT reproduce")
        return 0 if ok else 1
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    g, e = result["gemm"], result["errors"]["projections"]
    print("projections: " + ", ".join(f"{k}={v:.4g}" for k, v in g.items()))
    for name, s in e.items():
        print(f"  {name}: median {s['median']:.1%}, p90 {s['p90']:.1%}, max {s['max']:.0%} ({s['rows']} rows)")
    print(f"wrote {args.out}")
    return 0


def flatten(d) -> list[float]:
    if isinstance(d, dict):
        return [x for k in sorted(d) for x in flatten(d[k])]
    return [float(d)] if isinstance(d, (int, float)) else []


if __name__ == "__main__":
    sys.exit(main())
