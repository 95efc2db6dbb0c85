"""``minibatch-engine route``: an OpenAI-compatible router in front of several
servers (``minibatch-engine serve``, vLLM, SGLang), with the cluster's
policies (:mod:`minibatch_engine.cluster.router`).

For each ``POST /v1/completions`` or ``/v1/chat/completions`` the router
builds one :class:`~minibatch_engine.cluster.router.ReplicaState` per healthy
backend and lets the policy choose:

* ``outstanding``: the router's own count of requests it sent there that have
  not ended (exact: every request passes through it);
* ``kv_usage``: the backend's ``kv_cache_usage_perc`` gauge under whatever
  prefix it uses (``minibatch:``, ``vllm:`` or any ``serve --metrics-prefix``;
  vLLM's older ``gpu_cache_usage_perc`` too), polled from its ``/metrics``
  every ``poll_interval`` seconds, so up to that old;
* ``prefix_tokens``: the request's expected prefix-cache hit there, from the
  router's :class:`~minibatch_engine.cluster.prefix_index.PrefixIndex` (what it
  sent where, in blocks of ``block_size`` tokens). The keys are token ids:
  a prompt sent as token ids (``bench --endpoint`` sends them) is used as is;
  a text prompt is tokenised with the served model's tokenizer when the router
  is given ``model``, and otherwise read as its UTF-8 bytes, an approximation
  whose blocks hold ``block_size`` bytes, not tokens. A chat request's key is
  its messages joined as ``role\\ncontent\\n`` (not the server's chat template:
  a prefix of the conversation still gives a prefix of the key).

The request body goes to the chosen backend unchanged and its reply comes back
unchanged (server-sent events chunk by chunk, as they arrive), with one header
added: ``X-Routed-To`` (the backend's URL). A backend's error passes through
with its status. A backend that refuses the connection is marked unhealthy
and the request goes to the next choice; with no healthy backend left the
router answers 503. A client that goes away closes the upstream connection,
so the backend aborts the request (and frees its KV cache).

With ``api_key`` (``route --api-key``, default ``$MINIBATCH_API_KEY`` then
``$VLLM_API_KEY``, as ``serve``) the router asks clients for that key on
``/v1/*`` (:mod:`.access`) and sends it to the backends, which share it;
without, a client's ``Authorization`` header passes through unchanged, to
``/v1/models`` too.

``GET /v1/models`` asks a healthy backend; ``GET /health`` is 200 while at
least one backend is healthy (its ``/health`` answered 200 at the last poll);
``GET /metrics`` has the router's own series (``minibatch_router:``: requests
routed and in flight, errors, expected prefix hits, per backend) followed by
every backend's series with a ``backend`` label added, so a client that sums a
counter over labels (``bench --endpoint``) reads the cluster's total.
"""
from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from typing import Sequence

import aiohttp
from aiohttp import web

from ...cluster.prefix_index import PrefixIndex, block_hashes
from ...cluster.router import ReplicaState, RouterPolicy, make_router
from .access import api_key_middleware
from .errors import error_middleware
from .launch import STATE_KEY
from .limits import ConnectionLimits, read_body, run_forever
from .protocol import APIError, parse_json

PREFIX = "minibatch_router:"
KV_GAUGES = ("kv_cache_usage_perc", "gpu_cache_usage_perc")      # after any "prefix:"
ROUTED_HEADER = "X-Routed-To"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Backend:
    """One server behind the router, as the router sees it."""
    index: int
    url: str
    healthy: bool = False
    outstanding: int = 0            # requests sent there, not yet ended
    routed: int = 0                 # requests sent there since start
    errors: int = 0                 # connections refused or failed
    kv_usage: float = 0.0
    prefix_hit_tokens: int = 0      # expected prefix-cache hits of the requests routed there

    def state(self, prefix_tokens: int) -> ReplicaState:
        return ReplicaState(self.index, self.outstanding, self.kv_usage, prefix_tokens)


def _base(url: str) -> str:
    from ...harness.endpoint_client import base_url
    return base_url(url, "--backend")


def build_router_app(backends: Sequence[str], policy: str | RouterPolicy = "round-robin",
                     max_imbalance: int | None = None, model: str | None = None, block_size: int = 16,
                     poll_interval: float = 0.5, connect_timeout: float = 5.0,
                     limits: ConnectionLimits | None = None, api_key: str | None = None) -> web.Application:
    """The router application (the module doc). ``backends``: the servers'
    URLs (with or without ``/v1``); ``policy``: a name from
    :data:`~minibatch_engine.cluster.router.ROUTER_POLICIES` or a policy
    object; ``max_imbalance``: the prefix policy's load guard (requests; its
    default when None); ``model``: a model whose tokenizer keys text prompts
    (``"tiny"``, ``"tiny-py"``, a checkpoint directory); ``block_size``: tokens
    per prefix block (the backends' KV block size); ``limits``: the client
    connections' deadlines and bound (:mod:`.limits`); ``api_key``: the
    key clients must send and the backends get (the module doc)."""
    urls = [_base(u) for u in backends]
    if not urls:
        raise ValueError("the router needs at least one backend (--backend URL)")
    if len(set(urls)) != len(urls):
        raise ValueError(f"a backend is listed twice: {urls}")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if not poll_interval > 0:
        raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
    options = {} if max_imbalance is None else {"max_imbalance": max_imbalance}
    if options and policy != "prefix":
        raise ValueError(f"max_imbalance is the prefix policy's load guard; policy {policy!r} takes none")
    chooser = make_router(policy, **options)
    tokenizer = _tokenizer(model) if model is not None else None
    guards = [api_key_middleware([api_key])] if api_key else []
    app = web.Application(middlewares=[*guards, error_middleware()])
    app[STATE_KEY] = {"upstream_auth": f"Bearer {api_key}" if api_key else None, "backends": [Backend(i, u) for i, u in enumerate(urls)], "policy": chooser,
                      "index": PrefixIndex(len(urls), block_size), "tokenizer": tokenizer,
                      "poll_interval": poll_interval, "connect_timeout": connect_timeout,
                      "no_backend": 0, "drain_timeout": 5.0, "limits": limits or ConnectionLimits()}
    app.add_routes([web.post(p, _proxy) for p in GENERATION_PATHS] +
                   [web.get("/v1/models", _models), web.get("/health", _health), web.get("/metrics", _metrics)])
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


def _tokenizer(model: str):
    from ...model.registry import BUILT_IN, tokenizer_for
    from ...model.trained import TRAINED_MODELS, trained_model_path
    source = trained_model_path(model.lower()) if model.lower() in TRAINED_MODELS else model
    tok = tokenizer_for(source if model.lower() not in BUILT_IN else model.lower())
    if tok is None:
        raise ValueError(f"--model {model!r}: no tokenizer found there ('tiny', a trained model or a "
                         "checkpoint directory with tokenizer.json); drop --model to key prompts by bytes")
    return tok


# --- background: the backends' health and KV usage -----------------------------------
async def _start(app: web.Application) -> None:
    st = app[STATE_KEY]
    st["session"] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=st["connect_timeout"]))
    await _poll_all(app)                     # know who is up before the first request
    st["poller"] = asyncio.create_task(_poll_forever(app))


async def _stop(app: web.Application) -> None:
    st = app[STATE_KEY]
    st["poller"].cancel()
    await asyncio.gather(st["poller"], return_exceptions=True)
    await st["session"].close()


async def _poll_forever(app: web.Application) -> None:
    while True:
        await asyncio.sleep(app[STATE_KEY]["poll_interval"])
        await _poll_all(app)


async def _poll_all(app: web.Application) -> None:
    st = app[STATE_KEY]
    await asyncio.gather(*(_poll(st["session"], b, st["connect_timeout"]) for b in st["backends"]))


async def _poll(session, b: Backend, timeout: float) -> None:
    t = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(f"{b.url}/health", timeout=t) as r:
            b.healthy = r.status == 200
        async with session.get(f"{b.url}/metrics", timeout=t) as r:
            text = await r.text() if r.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        b.healthy = False
        return
    b.kv_usage = kv_usage_from(text)


def kv_usage_from(metrics_text: str) -> float:
    """The KV-cache usage a backend's ``/metrics`` reports, under any prefix
    (the largest, should it report several: its model names or prefixes)."""
    usage = [float(line.rpartition(" ")[2]) for line in metrics_text.splitlines()
             if not line.startswith("#") and ":" in (name := line.split("{", 1)[0].split(" ", 1)[0])
             and name.rpartition(":")[2] in KV_GAUGES]
    return max(usage, default=0.0)


# --- routing ---------------------------------------------------------------------------
def prefix_key(body: dict, path: str, tokenizer) -> list[int]:
    """The token ids the prefix index keys this request by (the module doc)."""
    if path.endswith("/chat/completions"):
        msgs = body.get("messages") if isinstance(body.get("messages"), list) else []
        text = "".join(f"{m.get('role', '')}\n{m.get('content', '')}\n" for m in msgs if isinstance(m, dict))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                 # several prompts: the first one decides
        if isinstance(prompt, list):
            return [t for t in prompt if isinstance(t, int)]
        text = prompt if isinstance(prompt, str) else ""
    if tokenizer is not None:
        try:
            return list(tokenizer.encode(text))
        except (TypeError, ValueError, UnicodeEncodeError):
            pass
    return list(text.encode("utf-8", "replace"))


def choose(st: dict, hashes: list[int], exclude: set[int]) -> Backend | None:
    """The policy's pick among the healthy backends not in ``exclude`` (None if none)."""
    ready = [b for b in st["backends"] if b.healthy and b.index not in exclude]
    if not ready:
        return None
    hits = st["index"].match((), hashes)
    picked = st["backends"][st["policy"].choose([b.state(hits[b.index]) for b in ready])]
    picked.prefix_hit_tokens += hits[picked.index]
    return picked


async def _proxy(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE_KEY]
    raw = await read_body(request, st["limits"].body_timeout)
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    hashes = block_hashes(prefix_key(body, request.path, st["tokenizer"]), st["index"].block_size)
    headers = _upstream_headers(request)
    tried: set[int] = set()
    while True:
        b = choose(st, hashes, tried)          # no await between the choice and the count
        if b is None:
            st["no_backend"] += 1
            down = [x.url for x in st["backends"] if not x.healthy]
            raise APIError(f"no backend is available (unhealthy: {', '.join(down) or 'none'}; "
                           f"tried: {', '.join(st['backends'][i].url for i in sorted(tried)) or 'none'})",
                           status=503)
        b.outstanding += 1
        try:
            upstream = await st["session"].post(f"{b.url}{request.path}", data=raw, headers=headers)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
            b.outstanding -= 1
            _mark_down(b, e)
            tried.add(b.index)
            continue
        except BaseException:                  # the client left while connecting
            b.outstanding -= 1
            raise
        break
    b.routed += 1
    st["index"].record(b.index, (), hashes)
    try:
        return await _relay(request, upstream, b)
    except BaseException:                      # the client left (or the backend broke): drop the upstream
        upstream.close()                       # connection, so the backend aborts the request
        raise
    finally:
        upstream.release()
        b.outstanding -= 1


def _mark_down(b: Backend, e: BaseException, when: str = "") -> None:
    """A backend that failed a connection: skipped until its ``/health`` answers 200 again."""
    b.healthy, b.errors = False, b.errors + 1
    print(f"minibatch-engine route: {b.url} is down ({type(e).__name__}{when}); skipped until it answers "
          "/health", file=sys.stderr, flush=True)


UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse, b: Backend) -> web.StreamResponse:
    """The backend's reply, passed on as it comes. If the backend breaks midway
    (killed, connection lost), a whole reply answers 502; a stream that has
    begun ends with an OpenAI-shaped error event and ``[DONE]``, as a server's
    own failure would end it; either way the backend is marked down. A client
    that leaves drops the upstream connection, so the backend aborts."""
    ctype = upstream.headers.get("Content-Type", "application/json")
    headers = {ROUTED_HEADER: b.url}
    if "Retry-After" in upstream.headers:
        headers["Retry-After"] = upstream.headers["Retry-After"]
    if upstream.status != 200 or not ctype.startswith("text/event-stream"):
        try:
            body = await upstream.read()
        except UPSTREAM_ERRORS as e:
            _mark_down(b, e, " mid-reply")
            raise APIError(f"the backend {b.url} failed mid-reply ({type(e).__name__}); retry", status=502) from None
        return web.Response(body=body, status=upstream.status, headers={**headers, "Content-Type": ctype})
    resp = web.StreamResponse(status=200, headers={**headers, "Content-Type": ctype, "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        tail = b"\n\n"                            # the last bytes relayed: an event ends with a blank line
        while True:
            try:
                chunk = await upstream.content.readany()
            except UPSTREAM_ERRORS as e:          # the backend broke mid-stream
                _mark_down(b, e, " mid-stream")
                err = APIError(f"the backend {b.url} failed mid-stream ({type(e).__name__}); the reply is "
                               "incomplete", status=502)
                sep = b"" if tail.endswith(b"\n\n") else b"\n\n"
                await resp.write(sep + b"data: " + json.dumps(err.body()).encode() + b"\n\ndata: [DONE]\n\n")
                break
            if not chunk:
                break
            await resp.write(chunk)
            tail = (tail + chunk)[-2:]
        await resp.write_eof()
    except ConnectionResetError:        # the client left mid-stream (or right after [DONE]):
        upstream.close()                # drop the upstream connection, so the backend aborts
    return resp


def _upstream_headers(request) -> dict:
    """The headers a backend gets: the body's type and the key (the router's own, else the client's)."""
    headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
    auth = request.app[STATE_KEY]["upstream_auth"]
    if auth is not None:
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"} | {"Authorization": auth}
    return headers


# --- small routes ------------------------------------------------------------------------
async def _models(request):
    st = request.app[STATE_KEY]
    for b in st["backends"]:
        if b.healthy:
            try:
                async with st["session"].get(f"{b.url}/v1/models", headers=_upstream_headers(request)) as r:
                    return web.Response(body=await r.read(), status=r.status,
                                        headers={"Content-Type": r.headers.get("Content-Type",
                                                                               "application/json")})
            except (aiohttp.ClientError, OSError):
                b.healthy = False
    raise APIError("no backend is available", status=503)


async def _health(request):
    if any(b.healthy for b in request.app[STATE_KEY]["backends"]):
        return web.Response(status=200)
    return web.json_response(APIError("no backend is healthy", status=503).body(), status=503)


ROUTER_SERIES = [  # (name, type, help, Backend attribute)
    ("requests_routed_total", "counter", "Requests sent to the backend.", "routed"),
    ("requests_in_flight", "gauge", "Requests sent to the backend and not yet ended.", "outstanding"),
    ("backend_up", "gauge", "1 if the backend answered /health at the last poll.", "healthy"),
    ("backend_kv_cache_usage_perc", "gauge", "The backend's KV-cache usage at the last poll.", "kv_usage"),
    ("backend_errors_total", "counter", "Connections to the backend that failed.", "errors"),
    ("expected_prefix_hit_tokens_total", "counter",
     "Prompt tokens the router expected in the backend's prefix cache.", "prefix_hit_tokens"),
]


def router_exposition(backends: Sequence[Backend], no_backend: int) -> str:
    """The router's own series in Prometheus's text format."""
    lines = []
    for name, kind, doc, attr in ROUTER_SERIES:
        lines += [f"# HELP {PREFIX}{name} {doc}", f"# TYPE {PREFIX}{name} {kind}"]
        lines += [f'{PREFIX}{name}{{backend="{b.url}"}} {float(getattr(b, attr))}' for b in backends]
    lines += [f"# HELP {PREFIX}no_backend_total Requests refused with 503: no backend available.",
              f"# TYPE {PREFIX}no_backend_total counter", f"{PREFIX}no_backend_total {float(no_backend)}"]
    return "\n".join(lines) + "\n"


def federate(texts: dict[str, str]) -> str:
    """The backends' expositions as one: each series once (its first HELP and
    TYPE), every sample with a ``backend`` label added."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for url, text in texts.items():
        current = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ", 3)[2]
                meta, _ = families.setdefault(current, ([], []))
                if not any(m.startswith(line[:7]) for m in meta):
                    meta.append(line)
            elif line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                name, brace, labels = key.partition("{")
                labels = f'backend="{url}"' + (f",{labels[:-1]}" if brace and labels != "}" else "")
                sample = f"{name}{{{labels}}} {value}"
                families.setdefault(current or name, ([], []))[1].append(sample)
    return "".join("\n".join(meta + samples) + "\n" for meta, samples in families.values())


async def _metrics(request):
    st = request.app[STATE_KEY]

    async def fetch(b: Backend):
        try:
            async with st["session"].get(f"{b.url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                return b.url, (await r.text() if r.status == 200 else "")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return b.url, ""
    texts = dict(await asyncio.gather(*(fetch(b) for b in st["backends"] if b.healthy)))
    body = router_exposition(st["backends"], st["no_backend"]) + federate(texts)
    return web.Response(text=body, content_type="text/plain", charset="utf-8")


def route(app: web.Application, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Run the router in the foreground until SIGTERM or SIGINT."""
    st = app[STATE_KEY]
    print(f"minibatch-engine route: {st['policy']!r} over {', '.join(b.url for b in st['backends'])} on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    run_forever(app, host, port, st["limits"], st["drain_timeout"])


__all__ = ["Backend", "build_router_app", "federate", "prefix_key", "route", "router_exposition"]
