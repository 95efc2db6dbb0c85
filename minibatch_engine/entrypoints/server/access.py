"""Who may call the server: an API key on ``/v1/*`` and CORS for browsers.

**API key** (``serve --api-key KEY``, or the environment's
``MINIBATCH_API_KEY``, else ``VLLM_API_KEY`` so a vLLM deployment's setting
works unchanged). Every request under ``/v1`` must carry
``Authorization: Bearer KEY``, or it is answered 401 in OpenAI's error shape;
so must ``POST /reset_prefix_cache`` (vLLM serves it in its dev mode only).
As in vLLM, the rest stays open: ``/health`` and ``/metrics`` (probes and
Prometheus scrape without a key), ``/version`` and the tokenizer routes. The
key is compared in constant time. It is no substitute for TLS: on any network
but loopback, put the server behind a proxy that terminates HTTPS.

**CORS** (``serve --allowed-origins``, ``--allowed-methods``,
``--allowed-headers``, ``--allow-credentials``): which web pages a browser
lets call the server. A preflight (``OPTIONS`` with
``Access-Control-Request-Method``) from an allowed origin is answered 204
with the allowed methods and headers, before the key is checked (browsers
send no credentials on a preflight); other responses to an allowed origin
carry ``Access-Control-Allow-Origin``. Unlike vLLM, whose default is every
origin, the default here is none: a server on loopback with no key should not
be callable by whatever page a browser has open. ``*`` allows every origin.
"""
from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

from aiohttp import web

from .protocol import APIError

API_KEY_ENV = ("MINIBATCH_API_KEY", "VLLM_API_KEY")


def api_key_from_env() -> str | None:
    """The first of ``MINIBATCH_API_KEY`` and ``VLLM_API_KEY`` that is set and not empty."""
    for name in API_KEY_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return None


def api_key_middleware(keys: list[str]):
    """401 for a ``/v1`` request (or a prefix-cache reset) without ``Authorization: Bearer <one of keys>``."""
    wanted = [k.encode() for k in keys]
    if not wanted or not all(wanted):
        raise ValueError("--api-key must be a non-empty string")

    @web.middleware
    async def check_key(request, handler):
        if (request.path.startswith("/v1") or request.path == "/reset_prefix_cache") \
                and request.method != "OPTIONS":
            given = request.headers.get("Authorization", "")
            token = given[7:].encode() if given[:7].lower() == "bearer " else b""
            if not any(hmac.compare_digest(token, k) for k in wanted):    # every key compared: no early out
                e = APIError("invalid or missing API key: send 'Authorization: Bearer <key>' with the "
                             "server's --api-key", status=401)
                body = e.body()
                body["error"]["type"] = "invalid_request_error"
                return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return check_key


@dataclass(frozen=True)
class CorsPolicy:
    """What a browser may do from another origin (the module doc)."""
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("GET", "POST", "OPTIONS")
    allowed_headers: tuple[str, ...] = ("Authorization", "Content-Type")
    allow_credentials: bool = False
    max_age: int = 600

    def __post_init__(self):
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials cannot go with --allowed-origins '*' (browsers refuse it): "
                             "name the origins")

    def origin_allowed(self, origin: str | None) -> bool:
        return bool(origin) and ("*" in self.allowed_origins or origin in self.allowed_origins)

    def allow_origin_value(self, origin: str) -> str:
        return "*" if "*" in self.allowed_origins and not self.allow_credentials else origin


def cors_middleware(policy: CorsPolicy):
    """Answers preflights (before any other check); see :func:`add_cors_headers` for the rest."""

    @web.middleware
    async def preflight(request, handler):
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            origin = request.headers.get("Origin")
            method = request.headers["Access-Control-Request-Method"].upper()
            if not policy.origin_allowed(origin) or ("*" not in policy.allowed_methods
                                                     and method not in policy.allowed_methods):
                return web.Response(status=403, text="CORS preflight refused: origin or method not allowed")
            asked = request.headers.get("Access-Control-Request-Headers", "")
            headers = {"Access-Control-Allow-Origin": policy.allow_origin_value(origin),
                       "Access-Control-Allow-Methods": ", ".join(policy.allowed_methods),
                       "Access-Control-Allow-Headers": asked if "*" in policy.allowed_headers and asked
                       else ", ".join(policy.allowed_headers),
                       "Access-Control-Max-Age": str(policy.max_age), "Vary": "Origin"}
            if policy.allow_credentials:
                headers["Access-Control-Allow-Credentials"] = "true"
            return web.Response(status=204, headers=headers)
        return await handler(request)
    return preflight


def add_cors_headers(policy: CorsPolicy):
    """An ``on_response_prepare`` hook: every response to an allowed origin,
    streamed ones and errors included, says so before its headers go out."""

    async def hook(request, response):
        origin = request.headers.get("Origin")
        if policy.origin_allowed(origin) and "Access-Control-Allow-Origin" not in response.headers:
            response.headers["Access-Control-Allow-Origin"] = policy.allow_origin_value(origin)
            response.headers.add("Vary", "Origin")
            if policy.allow_credentials:
                response.headers["Access-Control-Allow-Credentials"] = "true"
    return hook
