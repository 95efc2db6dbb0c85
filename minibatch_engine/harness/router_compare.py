"""Routers side by side in front of the same ``serve`` replicas: the vLLM
project's router (vllm-router, from PyPI) with each of its policies, the book's
own ``minibatch-engine route`` with each of chapter 12's, and the simulator's
prediction for the same requests (chapter 12, issue 45).

One run starts ``replicas`` ``minibatch-engine serve --model tiny-py``
processes with KV-cache events on. Then, for each workload and each router
policy in turn, it empties the replicas' prefix caches (``POST
/reset_prefix_cache``), starts a fresh router process, sends the workload
through it with chapter 8's open-loop client, and reads from every replica's
``/metrics`` what the run added: prefix-cache hits and lookups (tokens) and
requests served. The client's TTFT percentiles come from the streamed replies.

The workloads are chapter 12's prefix workloads (``multi-turn``,
``system-prompts``), drawn over 95 printable characters and sent as text (one
byte-level token each for tiny-py), because vllm-router keys its
``cache_aware`` tree on prompt text. A prompt that would not fit tiny-py's 2048
positions loses its tail. Each request carries its conversation (or its
system prompt) in an ``X-Session-Id`` header, the key ``consistent_hash``
hashes first (without one it hashes the prompt, which changes every turn).
The simulator runs the same requests on two simulated replicas (Llama-3-8B on
H100s, as in the chapter): its hit rate and balance are the prediction; its
times are another machine's.

    python -m minibatch_engine.harness.router_compare --out benchmarks/router_compare.json

takes about ten minutes on two CPU cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from ..book.report import Table
from ..cluster.colocated import simulate_cluster
from ..entrypoints.server.metrics import parse_metrics
from .endpoint_client import _run, open_loop_endpoint, summarize_endpoint
from .metrics import DEFAULT_PERCENTILES, parse_percentiles
from .workload import make_workload

VLLM_POLICIES = ("round_robin", "power_of_two", "cache_aware", "consistent_hash", "kv_aware")
BOOK_POLICIES = ("round-robin", "least-requests", "least-kv", "prefix")
# The simulator's routers: name -> (policy, where the prefix match comes from).
SIMULATED = {"round-robin": ("round-robin", "router"), "least-requests": ("least-requests", "router"),
             "least-kv": ("least-kv", "router"), "prefix": ("prefix", "router"),
             "prefix, from the replicas": ("prefix", "replica")}
# The simulated router nearest to each live one (None: the simulator has none like it).
NEAREST = {("vllm-router", "round_robin"): "round-robin", ("vllm-router", "power_of_two"): "least-requests",
           ("vllm-router", "cache_aware"): "prefix", ("vllm-router", "consistent_hash"): None,
           ("vllm-router", "kv_aware"): "prefix, from the replicas",
           **{("route", p): p for p in BOOK_POLICIES}}
WORKLOADS = {"multi-turn": 4.0, "system-prompts": 4.0}     # name -> arrival rate (requests/s)
MODEL, BLOCK, MAX_MODEL_LEN, ALPHABET = "tiny-py", 16, 2048, 95
STORED = Path(__file__).resolve().parents[2] / "benchmarks" / "router_compare.json"   # the committed run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fitted_workload(name: str, num_requests: int, seed: int, rate: float) -> list:
    """The named workload over :data:`ALPHABET` token ids, each prompt cut at its
    tail to fit ``MAX_MODEL_LEN`` with its output."""
    out = []
    for s in make_workload(name, num_requests, seed=seed, vocab_size=ALPHABET, arrival_rate=rate):
        room = MAX_MODEL_LEN - s.max_tokens
        out.append(replace(s, prompt_token_ids=s.prompt_token_ids[:room]))
    return out


def render(spec) -> dict:
    """The request's prompt as text: token ``t`` is the character ``chr(32 + t)``."""
    return {"prompt": "".join(chr(32 + t) for t in spec.prompt_token_ids)}


def session(spec) -> dict:
    """The request's conversation (or system prompt) as an ``X-Session-Id`` header."""
    return {"X-Session-Id": spec.client_id or spec.request_class or "none"}


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_up(url: str, proc: subprocess.Popen, path: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _get(url + path)
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(proc.args)} exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer {path} in {timeout:.0f} s") from None
            time.sleep(0.2)


def replica_counts(urls) -> list[dict]:
    """Per replica: prefix-cache hits and lookups (tokens) and requests ended, as counted so far."""
    rows = []
    for u in urls:
        m = parse_metrics(_get(f"{u}/metrics"))
        def total(name):
            return sum(v for k, v in m.items() if k.split("{")[0] == f"minibatch:{name}")
        rows.append({"hits": total("prefix_cache_hits_total"), "queries": total("prefix_cache_queries_total"),
                     "requests": total("request_success_total")})
    return rows


def start_replicas(n: int, log_dir: Path) -> list[dict]:
    out = []
    for i in range(n):
        port, pub, replay = free_port(), free_port(), free_port()
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
               "replay_endpoint": f"tcp://*:{replay}", "topic": ""}
        cmd = [sys.executable, "-m", "minibatch_engine", "serve", "--model", MODEL, "--port", str(port),
               "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-events-config", json.dumps(cfg)]
        proc = subprocess.Popen(cmd, stdout=open(log_dir / f"replica{i}.log", "w"), stderr=subprocess.STDOUT)
        out.append({"url": f"http://127.0.0.1:{port}", "pub": pub, "replay": replay, "proc": proc})
    try:
        for r in out:
            wait_up(r["url"], r["proc"], "/health", timeout=900)     # the first start compiles the kernels
    except BaseException:
        stop(out)
        raise
    return out


def stop(replicas) -> None:
    for r in replicas:
        r["proc"].terminate()
    for r in replicas:
        r["proc"].wait(timeout=60)


def router_command(router: str, policy: str, replicas, port: int, vllm_router: str) -> list[str]:
    urls = [r["url"] for r in replicas]
    if router == "route":
        return [sys.executable, "-m", "minibatch_engine", "route", *[a for u in urls for a in ("--backend", u)],
                "--policy", policy, "--model", MODEL, "--block-size", str(BLOCK), "--port", str(port)]
    cmd = [vllm_router, "--worker-urls", *urls, "--policy", policy, "--port", str(port),
           "--prometheus-port", str(free_port())]
    if policy == "kv_aware":
        for r in replicas:
            cmd += ["--kv-event-source", f"{r['url']}=tcp://127.0.0.1:{r['pub']}",
                    "--kv-event-replay-source", f"{r['url']}=tcp://127.0.0.1:{r['replay']}"]
        cmd += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", MODEL]
    return cmd


def live_run(router: str, policy: str, workload: str, specs, replicas, vllm_router: str, log_dir: Path) -> dict:
    """One router policy on one workload, on freshly emptied prefix caches."""
    urls = [r["url"] for r in replicas]
    for u in urls:
        req = urllib.request.Request(f"{u}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            if not json.loads(r.read())["reset"]:
                raise RuntimeError(f"{u} could not empty its prefix cache: requests still hold blocks")
    port = free_port()
    log = open(log_dir / f"{router}-{policy}-{workload}.log", "w")
    proc = subprocess.Popen(router_command(router, policy, replicas, port, vllm_router), stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, "/v1/models", timeout=120)
        before = replica_counts(urls)
        t0 = time.perf_counter()
        records, name, _, _ = _run(open_loop_endpoint(url, specs, MODEL, render=render, headers=session))
        wall = time.perf_counter() - t0
        after = replica_counts(urls)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    s = summarize_endpoint(records, specs, url=url, model=name, workload=workload, seed=0, arrival_rate=None,
                           burstiness=1.0, ps=parse_percentiles(DEFAULT_PERCENTILES), slo=None)
    delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    hits, queries = sum(d["hits"] for d in delta), sum(d["queries"] for d in delta)
    return {"router": router, "policy": policy, "workload": workload,
            "requests_per_replica": [int(d["requests"]) for d in delta],
            "hit_tokens": int(hits), "lookup_tokens": int(queries), "hit_rate": hits / queries,
            "failed": s["failed_requests"], "first_error": s.get("first_error"),
            **{k: s.get(k) for k in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "ttft_ms_mean")},
            "wall_s": wall, "simulated_as": NEAREST[(router, policy)]}


def predict(workload: str, router: str, num_requests: int = 48, seed: int = 0, replicas: int = 2) -> dict:
    """The simulator's run of the live requests behind ``router`` (a key of
    :data:`SIMULATED`): hit rate, requests per replica, TTFT on H100s."""
    policy, source = SIMULATED[router]
    specs = fitted_workload(workload, num_requests, seed, WORKLOADS[workload])
    s, _ = simulate_cluster(replicas, policy, workload, specs=specs, prefix_source=source,
                            sim_gpu="H100-SXM", sim_model="llama-3-8b")
    return {"hit_rate": s["prefix_hit_rate"], "requests_per_replica": [r["requests"] for r in s["per_replica"]],
            "ttft_ms_p50": s["ttft_ms_p50"], "ttft_ms_p99": s["ttft_ms_p99"]}


def comparison_table(live: dict, predicted: dict, workload: str) -> Table:
    """One line per live router policy on ``workload``: the replicas' hit rate
    beside the simulator's for its nearest router (``predicted``: (workload,
    simulated router) -> :func:`predict`'s result), balance and TTFT."""
    rows = []
    for r in live["runs"]:
        if r["workload"] == workload:
            near = r["simulated_as"]
            rows.append([r["router"], r["policy"], r["hit_rate"], near or "(none)",
                         predicted[(workload, near)]["hit_rate"] if near else "",
                         " / ".join(str(n) for n in r["requests_per_replica"]), r["ttft_ms_p50"], r["ttft_ms_p99"]])
    return Table(rows, ["router", "policy", "hit rate", "simulated as", "predicted hit rate",
                        "requests per replica", "TTFT p50 (ms)", "TTFT p99 (ms)"], floatfmt=".2f")


def vllm_router_version(binary: str) -> str | None:
    try:
        from importlib.metadata import version
        return version("vllm-router")
    except Exception:                       # noqa: BLE001  (installed outside this environment)
        return None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/router_compare.json", help="where the JSON goes")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--vllm-policies", nargs="*", default=list(VLLM_POLICIES), choices=VLLM_POLICIES)
    p.add_argument("--book-policies", nargs="*", default=list(BOOK_POLICIES), choices=BOOK_POLICIES)
    args = p.parse_args(argv)
    binary = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if args.vllm_policies and not Path(binary).is_file():
        raise SystemExit("vllm-router is not installed: pip install vllm-router==0.1.17")
    log_dir = Path(tempfile.mkdtemp(prefix="router_compare-"))
    result = {"command": "python -m minibatch_engine.harness.router_compare " + " ".join(argv or sys.argv[1:]),
              "vllm_router": vllm_router_version(binary), "model": MODEL, "replicas": args.replicas,
              "num_requests": args.num_requests, "seed": args.seed, "arrival_rates": WORKLOADS,
              "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK, "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "runs": [], "simulated": {}}
    replicas = start_replicas(args.replicas, log_dir)
    try:
        for w in args.workloads:
            specs = fitted_workload(w, args.num_requests, args.seed, WORKLOADS[w])
            result["simulated"][w] = {r: predict(w, r, args.num_requests, args.seed, args.replicas)
                                      for r in SIMULATED}
            jobs = [("vllm-router", q) for q in args.vllm_policies] + [("route", q) for q in args.book_policies]
            for router, policy in jobs:
                run = live_run(router, policy, w, specs, replicas, binary, log_dir)
                print(json.dumps({k: run[k] for k in ("router", "policy", "workload", "hit_rate",
                                                      "requests_per_replica", "ttft_ms_p50", "failed")}),
                      flush=True)
                result["runs"].append(run)
    finally:
        stop(replicas)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}; logs in {log_dir}")
    return result


if __name__ == "__main__":
    main()
