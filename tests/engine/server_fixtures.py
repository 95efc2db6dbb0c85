"""Fixtures and helpers shared by the HTTP server's test modules: one tiny
server per module, the official ``openai`` client on it, and the offline
``LLM`` with the same options (the reference a served reply must equal); raw
HTTP calls, ``/metrics`` read back, a wait until a server process answers, a
wait until a server is idle, and clients that leave their streams midway. A module imports them by name; it skips first
when the serve extra or ``openai`` is missing."""
import asyncio
import json
import random
import socket
import time
import urllib.error
import urllib.request

import pytest

from minibatch_engine import LLM
from minibatch_engine.entrypoints.server import ServerThread, make_app
from minibatch_engine.entrypoints.server.metrics import parse_metrics

OPTS = dict(device="cpu", attention_backend="sdpa", max_num_seqs=32, max_model_len=256)
#: the gauges of a server (or, summed, of a router's backends) with nothing left to do
IDLE = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}


@pytest.fixture(scope="module")
def server():
    with ServerThread(make_app("tiny", **OPTS)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny", **OPTS)


def free_port() -> int:
    """A loopback port nobody listens on (free when asked)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_started(proc, url: str, path: str = "/health", seconds: float = 300, name: str = "serve") -> str:
    """Poll ``url + path`` until the process ``proc`` answers; returns ``url``.
    A process that exits first, or one still silent after ``seconds``, fails
    with its stderr (when piped)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}{path}", timeout=5):
                return url
        except OSError:
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr is not None else ""
                raise RuntimeError(f"{name} exited ({proc.returncode}): {err}")
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{name} did not answer {path} within {seconds:.0f} s")


def post(url, body=None, path="/v1/completions", raw: bytes | None = None, timeout: float = 300):
    """POST ``body`` as JSON (or ``raw`` bytes): (status, the reply's JSON, headers), errors included."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def metrics(url) -> dict:
    """``GET /metrics``, parsed: series (with labels) -> value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode())


def gauges(url) -> dict:
    """The :data:`IDLE` gauges, each summed over its series (a router's are per backend)."""
    out = dict.fromkeys(IDLE, 0.0)
    for key, value in metrics(url).items():
        name = key.split("{", 1)[0].removeprefix("minibatch:")
        if name in out:
            out[name] += value
    return out


def wait_idle(url, seconds: float = 30) -> dict:
    """The gauges once they are all 0 (:data:`IDLE`), or as they stand after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        g = gauges(url)
        if not any(g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


def streams_that_leave(url, count: int, max_tokens: int, seed: int = 0, **fields) -> list[str]:
    """``count`` streamed completions at once (``fields`` added to each body),
    each of ``4..max_tokens`` tokens, whose clients leave at random: before the
    first chunk, after 1, 3 or 10, or never. Each one's outcome: "left" or "done"."""
    rng = random.Random(seed)

    async def one(session, i):
        body = {**fields, "prompt": f"request {i}", "max_tokens": rng.randint(4, max_tokens), "stream": True,
                "ignore_eos": True}
        leave_after = rng.choice([None, 0, 1, 3, 10])
        async with session.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200
            if leave_after == 0:
                return "left"
            seen = 0
            async for line in r.content:
                if line.startswith(b"data: {"):
                    seen += 1
                    if leave_after is not None and seen >= leave_after:
                        r.close()                           # the client goes away mid-stream
                        return "left"
        return "done"

    async def main():
        import aiohttp
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(count)))
    return asyncio.run(main())
