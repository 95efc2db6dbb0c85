"""P/D disaggregation between two ``minibatch-engine serve`` processes (issue 45,
item 3): a prefill replica (``kv_role: kv_producer``) and a decode replica
(``kv_consumer``), driven first by a small client that does what vLLM's toy
P/D proxy does, then by vllm-router's ``--vllm-pd-disaggregation`` (skipped
when it is not installed). Greedy text equals one replica's; the decode
replica computes one prompt token per request; both block pools end full; a
killed replica fails the request with an HTTP error, and the prefill's pinned
blocks come back at their timeout. About a minute here."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow          # make test-slow
pytest.importorskip("aiohttp")

from minibatch_engine.entrypoints.server import ServerThread, make_app  # noqa: E402

from .server_fixtures import free_port, post, wait_started  # noqa: E402
from .test_pd_transfer import proxy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
MODEL, PIN_S = "tiny-py", 3.0
FLAGS = ["--device", "cpu", "--attention-backend", "sdpa", "--max-model-len", "512", "--max-batch", "8"]
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "The quick brown fox",
           "import numpy as np\nx = np.arange(10)\n"]


def start_serve(role: str):
    """``serve --kv-transfer-config`` in a process of its own; returns (process, URL)."""
    port = free_port()
    cfg = {"kv_connector": "MinibatchConnector", "kv_role": role,
           "kv_connector_extra_config": {"pin_timeout_s": PIN_S, "pull_timeout_s": 20}}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIBATCH_NO_CPP": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minibatch_engine", "serve", "--model", MODEL, "--port", str(port),
                             *FLAGS, "--kv-transfer-config", json.dumps(cfg)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, wait_started(proc, f"http://127.0.0.1:{port}")


def stats(url) -> dict:
    with urllib.request.urlopen(f"{url}/kv_transfer/stats", timeout=30) as r:
        return json.loads(r.read())


def wait_freed(url, seconds: float = 30) -> dict:
    deadline = time.monotonic() + seconds
    while (s := stats(url))["blocks_in_use"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return s


@pytest.fixture(scope="module")
def pair():
    procs = [start_serve("kv_producer"), start_serve("kv_consumer")]
    one = ServerThread(make_app(MODEL, device="cpu", attention_backend="sdpa", max_model_len=512,
                                max_num_seqs=8)).start()
    yield one.url, procs[0][1], procs[1][1]
    one.stop()
    for p, _ in procs:
        p.kill()
        p.wait()


def reference(one, body, path="/v1/completions"):
    status, want, _ = post(one, body, path=path)
    assert status == 200, want
    return want


def test_two_serve_processes_and_a_small_client(pair):
    one, prefill, decode = pair
    before = stats(decode)
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
        _, status, got = proxy(prefill, decode, body)
        assert status == 200, got
        assert got["choices"][0]["text"] == reference(one, body)["choices"][0]["text"]
    after = stats(decode)
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(PROMPTS)
    assert after["loaded"] - before["loaded"] == len(PROMPTS)
    assert stats(prefill)["blocks_in_use"] == 0 and stats(prefill)["pins_held"] == 0
    assert after["blocks_in_use"] == 0


def start_router(prefill, decode):
    port = free_port()
    proc = subprocess.Popen([ROUTER, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                             "--port", str(port), "--prometheus-port", str(free_port()), "--policy", "round_robin"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, wait_started(proc, f"http://127.0.0.1:{port}", name="vllm-router")


def streamed_text(url, body, path):
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    text = ""
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"]
                if c:
                    text += c[0].get("text") or c[0].get("delta", {}).get("content") or ""
    return text


@pytest.mark.skipif(not Path(ROUTER).is_file(), reason="vllm-router is not installed (pip install vllm-router==0.1.17)")
def test_vllm_router_drives_the_pair(pair):
    one, prefill, decode = pair
    proc, url = start_router(prefill, decode)
    try:
        before = stats(decode)
        for prompt in PROMPTS:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
            status, got, _ = post(url, body)
            assert status == 200, got
            assert got["choices"][0]["text"] == reference(one, body)["choices"][0]["text"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Write a loop"}], "max_tokens": 8,
                "temperature": 0}
        want = reference(one, chat, "/v1/chat/completions")["choices"][0]["message"]["content"]
        assert streamed_text(url, chat, "/v1/chat/completions") == want
        after = stats(decode)
        # every request's prompt came over the wire: the decode replica computed one prompt token each
        assert after["loaded"] - before["loaded"] == len(PROMPTS) + 1
        assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(PROMPTS) + 1
        assert wait_freed(prefill)["blocks_in_use"] == 0 and stats(decode)["blocks_in_use"] == 0
    finally:
        proc.kill()
        proc.wait()


def test_killed_replicas_fail_cleanly():
    (pp, prefill), (dp, decode) = start_serve("kv_producer"), start_serve("kv_consumer")
    router = None
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
        # the decode replica dies: the request fails with an HTTP error, the prefill's pins come back
        if Path(ROUTER).is_file():
            router, url = start_router(prefill, decode)       # (it waits for both replicas to be healthy)
        dp.kill()
        dp.wait()
        if router is not None:
            t0 = time.monotonic()
            req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as err:      # the router's error body is plain text
                urllib.request.urlopen(req, timeout=120)
            assert err.value.code >= 500 and "Connection refused" in err.value.read().decode()
            assert time.monotonic() - t0 < 120
        else:                   # the prefill half of a proxy's request, whose decode half cannot be sent
            status, _, _ = post(prefill, dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
            assert status == 200
        freed = wait_freed(prefill, 10 * PIN_S)
        assert freed["blocks_in_use"] == 0 and freed["pins_held"] == 0 and freed["expired"] >= 1
        # the prefill replica dies after its answer: the decode replica answers 502 and holds nothing
        (dp, decode) = start_serve("kv_consumer")
        first = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        status, p, _ = post(prefill, first)
        assert status == 200
        pp.kill()
        pp.wait()
        status, err, _ = post(decode, dict(body, kv_transfer_params=p["kv_transfer_params"]), timeout=60)
        assert status == 502 and "could not pull" in err["error"]["message"]
        assert stats(decode)["blocks_in_use"] == 0
    finally:
        for proc in (pp, dp, router):
            if proc is not None:
                proc.kill()
                proc.wait()
