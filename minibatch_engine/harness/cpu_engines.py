"""Other CPU engines in the OpenVINO comparison (``bench --vs-openvino --also ...``).

Each adapter takes the same local Hugging Face Llama checkpoint and returns a
run over the comparison's workload (token-id prompts, greedy, each request
exactly its own number of output tokens), so it joins the same alternating
rounds as OpenVINO GenAI and the engine:

* ``transformers``: transformers' own continuous batching on the checkpoint in
  float32 (the runner of ``bench --vs-transformers``).
* ``ctranslate2``: CTranslate2's ``Generator`` on the checkpoint converted once
  to its format with float32 weights. It batches statically: the requests go in
  batches of ``batch`` prompts, each batch runs to its longest output, and only
  each request's own tokens are kept and counted.
* ``llama.cpp``: llama.cpp's HTTP server (``llama-server``, ``--parallel batch``
  slots, continuous batching) on the checkpoint converted once to an f32 GGUF;
  every request is sent at once, as token ids, with ``ignore_eos``.

:func:`start` runs each system in a process of its own, as a user would run it:
their thread pools (CTranslate2 brings its own OpenMP runtime), allocators and
loaded libraries then stay out of the process that times the engine.
OpenVINO GenAI itself runs the same way (``start("openvino", ...,
adapter=vs_openvino.openvino_adapter)``), so that the engine's process-wide
settings (glibc's malloc thresholds, :mod:`minibatch_engine.runner.cpu_memory`)
do not reach it either. A system that is not installed is skipped with the
reason (the comparison records it); nothing here is needed by the engine itself.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

OTHERS = ("transformers", "ctranslate2", "llama.cpp")


class Unavailable(RuntimeError):
    """The system cannot run here (the message says why and how to install it)."""


@dataclass
class OtherEngine:
    """A prepared system: ``run(prompts, max_tokens)`` returns every request's tokens."""
    name: str
    version: str
    settings: str
    run: Callable[[list[list[int]], list[int]], list[list[int]]]
    close: Callable[[], None] = field(default=lambda: None)


def check_names(names) -> None:
    """A ValueError naming the choices when a name is not one of :data:`OTHERS`."""
    for name in names:
        if name not in OTHERS:
            raise ValueError(f"--also takes {', '.join(OTHERS)}; got {name!r}")


def _adapter(name: str, adapter=None):
    """The function that prepares ``name``: ``adapter`` when given (a module-level
    function, so that a spawned process can import it), else one of :data:`OTHERS`."""
    if adapter is not None:
        return adapter
    check_names([name])
    return {"transformers": _transformers, "ctranslate2": _ctranslate2, "llama.cpp": _llama_cpp}[name]


def prepare(name: str, checkpoint: Path, cache_key: str, cache_dir: Path, batch: int, threads: int,
            kv_tokens: int = 65536, log=print, adapter=None, **options) -> OtherEngine:
    """The system ``name`` (one of :data:`OTHERS`, or any system ``adapter``
    prepares) ready to run on ``checkpoint`` with ``batch`` sequences at once
    on ``threads`` threads; converted files are kept in ``cache_dir`` under
    ``cache_key``. ``kv_tokens``: the KV cache a server must hold (every
    request's prompt and output at once). ``options``: the system's own
    settings, passed to ``adapter`` (OpenVINO's token budget and cache size)."""
    return _adapter(name, adapter)(Path(checkpoint), cache_key, Path(cache_dir), batch, threads, kv_tokens, log,
                                   **options)


def start(name: str, checkpoint: Path, cache_key: str, cache_dir: Path, batch: int, threads: int,
          kv_tokens: int = 65536, log=print, adapter=None, **options) -> OtherEngine:
    """:func:`prepare` in a process of its own (spawned): the returned run sends
    the workload over a pipe and waits for the tokens; ``close`` ends the process.
    The process's progress lines (a conversion) come back through ``log``.
    Raises :class:`Unavailable` as :func:`prepare` does."""
    _adapter(name, adapter)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(there, name, str(checkpoint), cache_key, str(cache_dir), batch,
                                            threads, kv_tokens, adapter, options), daemon=True,
                       name=f"cpu-engine-{name}")
    proc.start()
    there.close()

    def ask(*message):
        here.send(message)
        try:
            kind, payload = here.recv()
        except EOFError:
            raise RuntimeError(f"{name}'s process ended (exit code {proc.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"{name} failed in its process:\n{payload}")
        return payload

    def close():
        if proc.is_alive():
            try:
                here.send(("close",))
            except OSError:
                pass
            proc.join(30)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        here.close()
    try:
        kind, payload = here.recv()
        while kind == "log":
            log(payload)
            kind, payload = here.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"{name}'s process ended before it was ready (exit code {proc.exitcode})") from None
    if kind != "ready":
        close()
        if kind == "unavailable":
            raise Unavailable(payload)
        raise RuntimeError(f"{name} could not start in its process:\n{payload}")
    version, settings = payload
    return OtherEngine(name, version, settings, lambda prompts, max_tokens: ask("run", prompts, max_tokens), close)


def _worker(conn, name, checkpoint, cache_key, cache_dir, batch, threads, kv_tokens, adapter, options) -> None:
    """The other process of :func:`start`: prepare the system, then run what the pipe asks."""
    torch.set_num_threads(threads)
    log = lambda m: conn.send(("log", m))   # noqa: E731  (the parent's log prints it, or not)
    try:
        other = prepare(name, Path(checkpoint), cache_key, Path(cache_dir), batch, threads, kv_tokens, log,
                        adapter, **options)
    except Unavailable as e:
        conn.send(("unavailable", str(e)))
        return
    except Exception:   # noqa: BLE001 (sent to the parent, which raises it)
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", (other.version, other.settings)))
    try:
        while True:
            message = conn.recv()
            if message[0] == "close":
                break
            try:
                conn.send(("tokens", other.run(message[1], message[2])))
            except Exception:   # noqa: BLE001
                conn.send(("error", traceback.format_exc()))
    except EOFError:
        pass
    finally:
        other.close()


def _transformers(checkpoint, cache_key, cache_dir, batch, threads, kv_tokens, log) -> OtherEngine:
    try:
        import transformers
    except ImportError:
        raise Unavailable("transformers is not installed (pip install transformers)") from None
    from .vs_transformers import hf_caps_batch, run_hf_continuous
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    torch.set_num_threads(threads)
    cap = f"max_requests_per_batch {batch}" if hf_caps_batch() else "batch sized by tokens (no request cap)"
    return OtherEngine("transformers", transformers.__version__,
                       f"continuous batching, {cap}, float32, {threads} threads",
                       lambda prompts, max_tokens: run_hf_continuous(hf, prompts, max_tokens, batch))


def _ctranslate2(checkpoint, cache_key, cache_dir, batch, threads, kv_tokens, log) -> OtherEngine:
    try:
        import ctranslate2
        from ctranslate2.converters import TransformersConverter
    except ImportError:
        raise Unavailable("CTranslate2 is not installed (pip install ctranslate2)") from None
    out = cache_dir / f"ct2-{cache_key}"
    if not (out / "model.bin").is_file():
        log(f"converting {checkpoint} to CTranslate2 (float32) in {out}...")
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        TransformersConverter(str(checkpoint)).convert(str(tmp), quantization="float32", force=True)
        tmp.rename(out)
    vocab = json.loads((out / "vocabulary.json").read_text())   # token id -> the string it takes
    gen = ctranslate2.Generator(str(out), device="cpu", compute_type="float32", intra_threads=threads,
                                inter_threads=1)

    def run(prompts, max_tokens):
        results: list[list[int]] = []
        for b in range(0, len(prompts), batch):
            ms = max_tokens[b:b + batch]
            res = gen.generate_batch([[vocab[i] for i in p] for p in prompts[b:b + batch]],
                                     max_batch_size=batch, beam_size=1, sampling_topk=1,
                                     max_length=max(ms), min_length=max(ms), end_token=[],
                                     include_prompt_in_result=False)
            results += [list(r.sequences_ids[0][:m]) for r, m in zip(res, ms)]
        return results
    return OtherEngine("ctranslate2", ctranslate2.__version__,
                       f"Generator, static batches of {batch}, float32, intra_threads {threads}", run)


def llama_server_binary() -> str | None:
    """llama.cpp's ``llama-server``: the ``LLAMA_SERVER`` environment variable, else ``PATH``."""
    path = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return path if path and os.access(path, os.X_OK) else None


def write_gguf(checkpoint: Path, out: Path) -> None:
    """The Llama checkpoint as an f32 GGUF for llama.cpp, written with the ``gguf``
    package. Query and key rows are reordered for llama.cpp's rotary layout
    (adjacent pairs, where Hugging Face rotates the two halves of a head). The
    vocabulary is a placeholder (token i is ``<ti>``): prompts go in as ids. It
    declares no BOS or EOS token, so nothing is prepended and ``ignore_eos``
    masks nothing: every request keeps the model's own argmax, as in the engine."""
    import gguf
    from safetensors.torch import load_file
    cfg = json.loads((checkpoint / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"llama.cpp comparison: {checkpoint} is a {cfg.get('model_type')!r} model, not llama")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    weights = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(f)))

    def pairs(w, n):   # [n * head_dim, in]: each head's two halves interleaved
        return w.reshape(n, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)
    names = {"input_layernorm": "attn_norm", "self_attn.o_proj": "attn_output",
             "self_attn.v_proj": "attn_v", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("rwkv")          # llama.cpp gives this type no default BOS/EOS
    w.add_token_list([f"<t{i}>".encode() for i in range(cfg["vocab_size"])])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    f32 = lambda t: t.float().contiguous().numpy()   # noqa: E731
    w.add_tensor("token_embd.weight", f32(weights["model.embed_tokens.weight"]))
    w.add_tensor("output_norm.weight", f32(weights["model.norm.weight"]))
    if "lm_head.weight" in weights:                    # tied embeddings: llama.cpp reuses token_embd
        w.add_tensor("output.weight", f32(weights["lm_head.weight"]))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", f32(pairs(weights[p + "self_attn.q_proj.weight"], heads)))
        w.add_tensor(f"blk.{i}.attn_k.weight", f32(pairs(weights[p + "self_attn.k_proj.weight"], kv_heads)))
        for hf_name, name in names.items():
            w.add_tensor(f"blk.{i}.{name}.weight", f32(weights[p + hf_name + ".weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _llama_cpp(checkpoint, cache_key, cache_dir, batch, threads, kv_tokens, log) -> OtherEngine:
    binary = llama_server_binary()
    if binary is None:
        raise Unavailable("llama.cpp's llama-server was not found (build it from llama.cpp's sources, "
                          "cmake --build build --target llama-server, and put it on PATH or in LLAMA_SERVER)")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise Unavailable("the gguf package is not installed (pip install gguf)") from None
    model = cache_dir / f"gguf-{cache_key}-f32.gguf"
    if not model.is_file():
        log(f"converting {checkpoint} to an f32 GGUF in {model}...")
        tmp = model.with_name(model.name + ".partial")
        write_gguf(checkpoint, tmp)
        tmp.rename(model)
    port = _free_port()
    logfile = cache_dir / f"llama-server-{port}.log"
    args = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(batch), "-c", str(max(4096, kv_tokens)), "-kvu", "-cb",
            "--cache-type-k", "f32", "--cache-type-v", "f32", "--no-webui", "-cram", "0"]
    with open(logfile, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def close():
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            close()
            tail = logfile.read_text()[-600:]
            raise Unavailable(f"llama-server did not start (log {logfile}): {tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
    version = "?"
    try:
        with urllib.request.urlopen(url + "/props", timeout=5) as r:
            version = json.load(r).get("build_info", "?")
    except (OSError, ValueError):
        pass

    def complete(prompt, n):
        body = {"prompt": list(prompt), "n_predict": n, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return list(json.load(r)["tokens"])

    pool = ThreadPoolExecutor(max_workers=batch)

    def run(prompts, max_tokens):
        return list(pool.map(complete, prompts, max_tokens))

    def stop():
        pool.shutdown()
        close()
    return OtherEngine("llama.cpp", version,
                       f"llama-server, {batch} parallel slots, continuous batching, f32 GGUF and KV cache, "
                       f"{threads} threads; every request sent at once over HTTP", run, stop)
