"""P/D disaggregation over HTTP: vLLM's ``kv_transfer_params``, and a K/V pull between two servers.

``serve --kv-transfer-config '{"kv_connector": "MinibatchConnector", "kv_role":
"kv_producer"}'`` makes a prefill replica, ``"kv_consumer"`` a decode replica
(``"kv_both"``: either). vllm-router's ``--vllm-pd-disaggregation`` (or
vLLM's toy P/D proxy) then drives the pair with vLLM's request-level protocol:

1. The proxy sends the prefill replica the request with ``max_tokens: 1``,
   ``stream: false`` and ``kv_transfer_params: {"do_remote_decode": true}``.
   The engine computes the prompt and pins its blocks
   (:class:`~minibatch_engine.cluster.kv_transfer.PinningScheduler`); the
   response's ``kv_transfer_params`` say where they are:
   ``{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id",
   "remote_request_id", "remote_block_ids", "remote_host", "remote_port",
   "remote_num_tokens", "tp_size": 1}``.
2. The proxy sends the decode replica the original request with those
   parameters. Its handler pulls the K/V from ``remote_host:remote_port``,
   checks that they fit (same model, layer shapes, dtype and prompt), and
   submits the request with them: the engine writes them into the blocks its
   scheduler gives the request and computes only the prompt's last token (as
   vLLM does: its logits give the first output token).

The transport is one HTTP request, the decode replica pulling from the
prefill replica: ``POST /kv_transfer/pull`` with ``{"remote_request_id",
"remote_engine_id"}``. The answer is a 4-byte big-endian length, a JSON header
(the prefill engine's identity, the prompt's token ids, the tensor's shape
and dtype) and the raw K/V bytes, ``[layers, 2, tokens, kv heads, head
dim]``, tokens in prompt order. A pull unpins the blocks whatever happens
next; so does ``pin_timeout_s`` without a pull. Pulling rides on the server
and the connection the router already uses, needs no second port, and a dead
prefill replica fails fast (connection refused). NIXL, Mooncake and LMCache
replace it in production: the decode GPU reads the blocks in place, by RDMA,
with no copy through the host. Because the payload is in token order, the
two replicas' block sizes may differ; everything else must match.

``GET /kv_transfer/stats``: the connector's counters, with the prompt tokens
the model really computed (a decode replica computes one per request).
"""
from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import dataclass, field

import torch
from aiohttp import ClientError, ClientSession, ClientTimeout, web

from ...cluster.kv_transfer import PDConnector
from .json_flag import json_object_flag
from .protocol import APIError

CONNECTOR = "MinibatchConnector"
PARAM = "kv_transfer_params"
EXTRA = {"pin_timeout_s": 30.0, "pull_timeout_s": 30.0}
REAPER_KEY = web.AppKey("kv_transfer_reaper", asyncio.Task)


@dataclass(frozen=True)
class KVTransferConfig:
    """vLLM's ``KVTransferConfig`` fields this server implements (the JSON of
    ``--kv-transfer-config``). ``kv_ip``/``kv_port``: the address a decode
    replica pulls from (default: the address each request came in on).
    ``kv_connector_extra_config``: ``pin_timeout_s`` (seconds a prompt's blocks
    wait for their pull) and ``pull_timeout_s`` (seconds a pull may take)."""
    kv_connector: str
    kv_role: str
    engine_id: str | None = None
    kv_ip: str | None = None
    kv_port: int | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, value) -> "KVTransferConfig":
        """From a JSON object (text or dict); an unknown key or a bad value is a
        ValueError naming the field."""
        flag = "--kv-transfer-config"
        value = json_object_flag(value, flag, cls.__dataclass_fields__)
        for name in ("kv_connector", "kv_role"):
            if name not in value:
                raise ValueError(f"{flag}: {name} is required")
        if value["kv_connector"] != CONNECTOR:
            raise ValueError(f"{flag}: kv_connector {value['kv_connector']!r} is not available here; this "
                             f"engine has {CONNECTOR!r} (K/V pulled over HTTP)")
        port = value.get("kv_port")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"{flag}: kv_port must be a port in [1, 65535], got {port!r}")
        for name in ("engine_id", "kv_ip"):
            if value.get(name) is not None and not (isinstance(value[name], str) and value[name]):
                raise ValueError(f"{flag}: {name} must be a non-empty string, got {value[name]!r}")
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError(f"{flag}: kv_connector_extra_config must be an object")
        bad = sorted(set(extra) - set(EXTRA))
        if bad:
            raise ValueError(f"{flag}: unknown kv_connector_extra_config field(s) {', '.join(bad)} "
                             f"(known: {', '.join(EXTRA)})")
        for name, v in extra.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{flag}: kv_connector_extra_config.{name} must be a number > 0, got {v!r}")
        cfg = cls(**{**value, "kv_connector_extra_config": {**EXTRA, **extra}})
        cfg.connector_or_error()
        return cfg

    def connector_or_error(self) -> PDConnector:
        try:
            return PDConnector(self.kv_role, self.engine_id, self.kv_connector_extra_config["pin_timeout_s"])
        except ValueError as e:
            raise ValueError(f"--kv-transfer-config: {e}") from None

    @property
    def pull_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config["pull_timeout_s"])


@dataclass(frozen=True)
class Transfer:
    """What one request's ``kv_transfer_params`` ask of this server."""
    remote_decode: bool = False          # prefill here, keep the K/V for a decode replica
    remote_prefill: bool = False         # the prompt's K/V wait at remote_host:remote_port
    remote_request_id: str | None = None
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None


def plan(body: dict, req, connector: PDConnector | None) -> Transfer | None:
    """The request's transfer (None: none asked, or this server has no connector:
    the parameters are ignored, as by a vLLM server without a KV connector).
    Refuses, with a 400 naming ``kv_transfer_params``, what cannot work."""
    p = body.get(PARAM)
    if connector is None or p is None:
        return None
    if not isinstance(p, dict):
        raise APIError(f"'{PARAM}' must be an object", PARAM)
    t = Transfer(bool(p.get("do_remote_decode")), bool(p.get("do_remote_prefill")), p.get("remote_request_id"),
                 p.get("remote_engine_id"), p.get("remote_host"), p.get("remote_port"))
    if not (t.remote_decode or t.remote_prefill):
        return None
    if t.remote_decode and t.remote_prefill:
        raise APIError(f"'{PARAM}': do_remote_decode and do_remote_prefill cannot both be true", PARAM)
    if req.n != 1 or len(req.prompts) > 1:
        raise APIError(f"'{PARAM}': a disaggregated request has one prompt and n=1", PARAM)
    if t.remote_decode:
        if not connector.produces:
            raise APIError(f"'{PARAM}': do_remote_decode needs a prefill replica (kv_role kv_producer or "
                           f"kv_both); this server is {connector.role}", PARAM)
        if req.stream:
            raise APIError(f"'{PARAM}': do_remote_decode answers with the parameters in one JSON body: "
                           "send 'stream': false", PARAM)
        return t
    if not connector.consumes:
        raise APIError(f"'{PARAM}': do_remote_prefill needs a decode replica (kv_role kv_consumer or "
                       f"kv_both); this server is {connector.role}", PARAM)
    for name in ("remote_request_id", "remote_engine_id", "remote_host"):
        if not isinstance(getattr(t, name), str) or not getattr(t, name):
            raise APIError(f"'{PARAM}.{name}' must be a non-empty string with do_remote_prefill", f"{PARAM}.{name}")
    if isinstance(t.remote_port, bool) or not isinstance(t.remote_port, int) or not 0 < t.remote_port < 65536:
        raise APIError(f"'{PARAM}.remote_port' must be a port, got {t.remote_port!r}", f"{PARAM}.remote_port")
    return t


# --- the producer ------------------------------------------------------------------------
def response_params(request: web.Request, cfg: KVTransferConfig, connector: PDConnector,
                    engine_request_id: str) -> dict | None:
    """The response's ``kv_transfer_params`` for a finished prefill (None: the
    request ended without pinning, e.g. aborted)."""
    pin = connector.pinned(engine_request_id)
    if pin is None:
        return None
    host, port = request.transport.get_extra_info("sockname")[:2] if request.transport else ("127.0.0.1", 0)
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": connector.engine_id,
            "remote_request_id": engine_request_id, "remote_block_ids": list(pin.block_ids),
            "remote_host": cfg.kv_ip or host, "remote_port": cfg.kv_port or port,
            "remote_num_tokens": len(pin.token_ids), "tp_size": 1}


def _frame(header: dict, kv: torch.Tensor) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack(">I", len(head)) + head + kv.contiguous().view(torch.uint8).numpy().tobytes()


def _unframe(body: bytes) -> tuple[dict, torch.Tensor]:
    (n,) = struct.unpack(">I", body[:4])
    header = json.loads(body[4:4 + n])
    dtype = getattr(torch, header["dtype"])
    kv = torch.frombuffer(bytearray(body[4 + n:]), dtype=torch.uint8).view(dtype).reshape(header["shape"])
    return header, kv


def install(app: web.Application, llm_key, connector: PDConnector) -> None:
    """Add ``POST /kv_transfer/pull``, ``GET /kv_transfer/stats`` and the reaper:
    a task that, while pins are held, unpins those past their deadline (a
    pin whose reply never reached the proxy expires too)."""
    async def pull(request):
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise APIError("the body must be JSON: {\"remote_request_id\": ..., \"remote_engine_id\": ...}")
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object")
        rid, engine_id = body.get("remote_request_id"), body.get("remote_engine_id")
        if engine_id != connector.engine_id:
            raise APIError(f"this server is engine {connector.engine_id!r}, not {engine_id!r} (restarted since "
                           "the prefill?)", "remote_engine_id", 404)
        try:
            pin, kv = await request.app[llm_key].between_steps(lambda engine: connector.take(rid))
        except KeyError:
            raise APIError(f"no pinned K/V for request {rid!r}: pulled already, or dropped after "
                           f"pin_timeout_s={connector.pin_timeout_s:g} s", "remote_request_id", 404) from None
        header = {**connector.identity(), "token_ids": list(pin.token_ids), "shape": list(kv.shape),
                  "dtype": str(kv.dtype).removeprefix("torch.")}
        return web.Response(body=_frame(header, kv), content_type="application/octet-stream")

    async def stats(request):
        return web.json_response(await request.app[llm_key].between_steps(lambda engine: connector.snapshot()))
    async def reap(app):
        period = min(1.0, connector.pin_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            if connector.engine.scheduler.pinned:          # (read between steps or not: only a hint)
                try:
                    await app[llm_key].between_steps(lambda engine: connector.expire())
                except Exception:                           # noqa: BLE001  (the engine failed: /health says so)
                    return

    async def start(app):
        app[REAPER_KEY] = asyncio.create_task(reap(app))

    async def stop(app):
        task = app.get(REAPER_KEY)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    app.add_routes([web.post("/kv_transfer/pull", pull), web.get("/kv_transfer/stats", stats)])
    app.on_startup.append(start)
    app.on_shutdown.append(stop)


# --- the consumer ----------------------------------------------------------------------
async def pull(t: Transfer, prompt: list[int], connector: PDConnector, timeout_s: float) -> torch.Tensor:
    """Pull the prompt's K/V from the prefill replica and check it fits this
    engine; returns the K/V of every prompt token but the last. An unreachable
    or refusing replica is a 502, a mismatch a 400, both naming ``kv_transfer_params``."""
    url = f"http://{t.remote_host}:{t.remote_port}/kv_transfer/pull"
    try:
        async with ClientSession(timeout=ClientTimeout(total=timeout_s)) as s:
            async with s.post(url, json={"remote_request_id": t.remote_request_id,
                                         "remote_engine_id": t.remote_engine_id}) as r:
                body = await r.read()
                status = r.status
    except (ClientError, OSError, asyncio.TimeoutError) as e:
        raise APIError(f"could not pull the prompt's K/V from the prefill replica at {url}: "
                       f"{type(e).__name__}: {e}", PARAM, 502) from None
    if status != 200:
        try:
            why = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = body[:200].decode(errors="replace")
        raise APIError(f"the prefill replica at {url} refused the K/V pull ({status}): {why}", PARAM, 502)
    header, kv = _unframe(body)
    mine = connector.identity()
    for name in ("model", "num_layers", "num_kv_heads", "head_dim", "dtype", "kv_cache_dtype"):
        if header.get(name) != mine[name]:
            raise APIError(f"'{PARAM}': the prefill replica's {name} is {header.get(name)!r}, this decode "
                           f"replica's is {mine[name]!r}: its K/V cannot be used here", PARAM)
    if header["token_ids"] != list(prompt):
        raise APIError(f"'{PARAM}': the prefill replica computed a different prompt ({len(header['token_ids'])} "
                       f"tokens) than this request's ({len(prompt)} tokens)", PARAM)
    return kv[:, :, :len(prompt) - 1]
