"""``minibatch-engine serve`` on loopback, driven by the official ``openai``
client: the same text as the offline ``LLM``, streaming, ``n > 1``, stop
strings, usage, errors, disconnects, a full queue, SIGTERM, and
``bench --endpoint`` with the in-process run's metric set."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from minibatch_engine import SamplingParams  # noqa: E402
from minibatch_engine.entrypoints.server import ServerThread, make_app  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
from .server_fixtures import IDLE, OPTS, free_port, metrics, post, streams_that_leave, wait_idle  # noqa: E402
from .server_fixtures import wait_started  # noqa: E402
from .server_fixtures import client, offline, server  # noqa: E402,F401 (fixtures)
PROMPTS = ["The cat", "Serving under load", "a"]


def gauge(m: dict, name: str) -> float:
    return m[f'minibatch:{name}{{model_name="tiny"}}']


def test_greedy_completions_equal_the_offline_llm_and_count_usage(client, offline):
    ref = offline.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    for p, want in zip(PROMPTS, ref):
        r = client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.outputs[0].text and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 8)
        assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_streamed_deltas_join_to_the_same_text_with_usage_last(client, offline):
    want = offline.generate(PROMPTS[1:2], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.outputs[0].text
    assert sum(bool(c.choices) for c in chunks) == 10            # one chunk per token
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n_samples_equal_the_offline_forks(client, offline):
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=5, n=3, ignore_eos=True)
    want = offline.generate(["n > 1"], params, use_tqdm=False)[0]
    r = client.completions.create(model="tiny", prompt="n > 1", max_tokens=6, temperature=0.9, seed=5, n=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.text for o in want.outputs]
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_before_it(client, offline, stream):
    full = offline.generate(["stop here"], SamplingParams(max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    stop = next(full.text[i:i + 2] for i in range(3, 14) if "\ufffd" not in full.text[i:i + 2])
    cut = offline.generate(["stop here"], SamplingParams(max_tokens=16, ignore_eos=True, stop=stop),
                           use_tqdm=False)[0].outputs[0]
    args = dict(model="tiny", prompt="stop here", max_tokens=16, temperature=0, stop=[stop],
                extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**args)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens == len(cut.token_ids)
    assert (text, reason) == (cut.text, "stop") and text == full.text[:full.text.index(stop)]


def test_chat_streams_a_role_then_the_reply(client):
    msgs = [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


BAD = [({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "temperature": -1}, "temperature"),
       ({"prompt": "x", "top_p": 0}, "top_p"), ({"prompt": "x", "n": "2"}, "n"), ({}, "prompt"),
       ({"prompt": [1, 99999]}, "prompt"), ({"prompt": "x", "stop": 5}, "stop"),
       ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
       ({"prompt": "x", "priority": 1.5}, "priority"), ({"prompt": "x", "stream_options": {}}, "stream_options")]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_requests_get_400_naming_the_field_and_the_server_goes_on(server, client, body, param):
    status, err, _ = post(server.url, {"model": "tiny", **body})
    assert status == 400 and err["error"]["param"] == param and err["error"]["code"] == 400
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_bad_json_unknown_models_and_bad_messages(server, client):
    assert post(server.url, raw=b"{not json")[0] == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    status, err, _ = post(server.url, {"messages": [{"role": "robot", "content": "x"}]}, "/v1/chat/completions")
    assert status == 400 and err["error"]["param"] == "messages[0].role"


def test_many_streams_with_random_disconnects_leave_nothing_running(server, caplog):
    outcomes = streams_that_leave(server.url, 120, max_tokens=40, model="tiny")
    assert outcomes.count("left") > 30 and outcomes.count("done") > 10
    assert wait_idle(server.url, 20) == IDLE
    m = metrics(server.url)
    assert m['minibatch:request_success_total{finished_reason="abort",model_name="tiny"}'] > 0
    assert server.call(_held(server)) == 0
    # a client leaving is not a server error: no "Error handling request" traceback
    assert not [rec for rec in caplog.records if "Error handling request" in rec.getMessage()]


async def _held(server):
    return server.llm.engine.kv_cache.num_used_blocks


def test_metrics_use_vllms_names(server, client):
    client.completions.create(model="tiny", prompt="count me", max_tokens=3, extra_body={"ignore_eos": True})
    m = metrics(server.url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total"):
        assert f'minibatch:{name}{{model_name="tiny"}}' in m
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert m[f'minibatch:{name}_count{{model_name="tiny"}}'] >= 1
    assert gauge(m, "generation_tokens_total") >= 3


def test_a_full_queue_answers_503_with_retry_after():
    app = make_app("tiny", max_waiting=1, **{**OPTS, "max_num_seqs": 1})
    with ServerThread(app) as s:
        async def main():
            async with aiohttp.ClientSession() as session:
                async def one():
                    async with session.post(f"{s.url}/v1/completions", json={
                            "prompt": "slow", "max_tokens": 200, "ignore_eos": True}) as r:
                        return r.status, r.headers.get("Retry-After"), await r.json()
                return await asyncio.gather(*(one() for _ in range(4)))
        results = asyncio.run(main())
    busy = [r for r in results if r[0] == 503]
    assert len(busy) >= 2 and all(h == "1" and e["error"]["code"] == 503 for _, h, e in busy)
    assert sum(r[0] == 200 for r in results) >= 1


async def _stream_of(session, url, n):
    """(tokens, the last finish_reason, whether [DONE] came) of one streamed completion."""
    async with session.post(f"{url}/v1/completions", json={
            "prompt": "long", "max_tokens": n, "ignore_eos": True, "stream": True}) as r:
        chunks, reason, done = 0, None, False
        async for line in r.content:
            if line.startswith(b"data: {"):
                c = json.loads(line[6:])["choices"][0]
                chunks += c["finish_reason"] != "abort"     # one chunk per token; an abort brings none
                reason = c["finish_reason"] or reason
            done = done or line.startswith(b"data: [DONE]")
        return chunks, reason, done


def test_sigterm_drains_then_aborts_and_exits_cleanly(tmp_path):
    """What the code guarantees, whatever the machine's speed: the short stream
    (finished before the signal) is whole; each long one ends whole or with an
    abort event and [DONE]; the log counts those aborts; nothing is left behind."""
    import re
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIBATCH_NO_CPP": "1"}     # no kernel build to wait for
    proc = subprocess.Popen([sys.executable, "-m", "minibatch_engine", "serve", "--model", "tiny", "--port", str(port),
                             "--device", "cpu", "--attention-backend", "sdpa", "--shutdown-timeout", "1",
                             "--max-model-len", "1024"], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_started(proc, url)

        async def main():
            async with aiohttp.ClientSession() as session:
                tasks = [asyncio.create_task(_stream_of(session, url, n)) for n in (900, 900, 3)]
                await tasks[2]                          # the short one is done: then the signal
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks, return_exceptions=True)
        results = asyncio.run(main())
        err = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert results[2] == (3, "length", True)
    for chunks, reason, done in results[:2]:
        assert done and (reason == "abort" or (reason, chunks) == ("length", 900))
    aborted = re.search(r"aborted (\d+) streams still running after the drain", err)
    assert aborted and int(aborted.group(1)) == sum(r[1] == "abort" for r in results[:2]), err
    assert "stopped: 0 engine requests unfinished, 0 KV blocks held" in err
    assert "Traceback" not in err


def test_shutdown_aborts_exactly_the_streams_still_running_after_the_drain(monkeypatch):
    """The drain-then-abort path made certain: each step sleeps 20 ms, so a
    900-token stream outlasts a 0.5 s drain on any machine."""
    from minibatch_engine.core.engine import Engine
    from minibatch_engine.entrypoints.server.app import STATE_KEY
    real = Engine.step

    def slow_step(self):
        time.sleep(0.02)
        return real(self)
    monkeypatch.setattr(Engine, "step", slow_step)
    s = ServerThread(make_app("tiny", **OPTS), shutdown_timeout=0.5).start()

    async def main():
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(_stream_of(session, s.url, n)) for n in (200, 200, 3)]
            await tasks[2]
            await asyncio.get_running_loop().run_in_executor(None, s.stop)     # as SIGTERM: drain, then abort
            return await asyncio.gather(*tasks)
    results = asyncio.run(main())
    assert results == [(r[0], "abort", True) for r in results[:2]] + [(3, "length", True)]
    assert all(r[0] < 200 for r in results[:2])
    assert s.app[STATE_KEY]["aborted_at_shutdown"] == 2
    assert s.llm.engine.kv_cache.num_used_blocks == 0


def test_bench_endpoint_reports_the_in_process_metric_set(server, tmp_path):
    from minibatch_engine.harness.bench import format_report, run_bench
    from minibatch_engine.entrypoints.cli import main
    from minibatch_engine.harness.endpoint_client import bench_endpoint
    from minibatch_engine.harness.metrics import RequestTiming, serving_metrics
    local, _ = run_bench(num_requests=6, arrival_rate=40.0, model="tiny", max_batch=32, max_model_len=256,
                         device="cpu", attention_backend="sdpa", progress=False, goodput=["ttft:500"])
    remote = bench_endpoint(server.url, num_requests=6, arrival_rate=40.0, progress=False, goodput=["ttft:500"])
    metric_keys = set(serving_metrics([RequestTiming(0.0, [1.0, 2.0], 3)], goodput={"ttft": 500}))
    assert metric_keys <= set(local) and metric_keys <= set(remote)
    shared = {"workload", "num_requests", "seed", "arrival_rate", "burstiness", "clock", "finished_requests",
              "output_tokens", "wall_seconds", "output_tokens_per_second"}
    assert shared <= set(local) and shared <= set(remote)
    assert remote["clock"] == local["clock"] == "wall" and remote["completed"] == local["completed"] == 6
    assert remote["output_tokens"] == local["output_tokens"]          # the same seeded workload
    assert remote["server_generation_tokens_total"] == remote["output_tokens"]
    assert "TTFT" in format_report(remote)
    out = tmp_path / "bench.json"
    assert main(["bench", "--endpoint", f"{server.url}/v1", "--num-requests", "4", "--arrival-rate", "50",
                 "--no-progress", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["completed"] == 4
    rows = tmp_path / "sweep.jsonl"
    assert main(["sweep", "--endpoint", server.url, "--rates", "20,40", "--num-requests", "4", "--no-progress",
                 "--jsonl", str(rows)]) == 0
    assert [json.loads(x)["rate"] for x in rows.read_text().splitlines()] == [20.0, 40.0]
