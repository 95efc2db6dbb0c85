"""What a server allows one client connection: a deadline for a request's
headers, another for its body, and a bound on open connections, so that slow
or idle clients cannot hold the server (nginx's ``client_header_timeout``,
``client_body_timeout`` and ``worker_connections``; Go's ``ReadHeaderTimeout``).

* **Headers**: a connection must deliver a complete request head within
  ``header_timeout`` seconds of opening, or of its previous response; one that
  has not is closed. An idle keep-alive connection is closed after as long
  (aiohttp's ``keepalive_timeout``; :class:`ConnectionGuard` also times the
  first request itself, which aiohttp before 3.13 did not).
* **Body**: a handler reads the body through :func:`read_body`, which answers
  408 if it has not all arrived ``body_timeout`` seconds after the headers.
* **Connections**: at ``max_connections`` open connections, a new one first
  closes the oldest connection with no request in progress (idle, or still
  sending its headers); if every connection is serving a request, the new one
  gets 503 with ``Retry-After`` and is closed. Slow clients therefore cannot
  keep out a client that sends its request whole. The bound also stays below
  the process's open-file limit (``ulimit -n``): at start the soft limit is
  raised toward the hard one if needed, and ``max_connections`` is lowered
  (one log line says so) to what remains after the files already open, a
  margin for the engine's own and one accept burst (the listen backlog).
  An ``accept()`` that still fails for want of files waits a second (asyncio
  retries) and logs one warning, not a traceback per attempt.

Both ``serve`` and ``route`` use them (:func:`start_site`, :func:`run_forever`).
"""
from __future__ import annotations

import asyncio
import errno
import json
import os
import sys
import time
from contextlib import suppress
from dataclasses import dataclass

from aiohttp import web

from .protocol import APIError


@dataclass(frozen=True)
class ConnectionLimits:
    """Deadlines (seconds) and the connection bound of the module doc."""
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    max_connections: int = 1024

    def __post_init__(self):
        for name in ("header_timeout", "body_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")
        m = self.max_connections
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_connections must be an integer >= 1, got {m!r}")


FILE_MARGIN = 64            # files kept for the engine's own use (logs, caches, pipes) beyond those open at start
BACKLOG = 128               # the listen backlog: asyncio accepts up to this many connections in one tick


def _open_files() -> int:
    for d in ("/proc/self/fd", "/dev/fd"):
        with suppress(OSError):
            return len(os.listdir(d))
    return 0


def file_bounded(max_connections: int) -> tuple[int, str | None]:
    """``max_connections`` bounded by this process's open-file limit (the
    module doc), raising the soft limit toward the hard one first; the bound
    and, when it lowered the flag's value, the log line that says so."""
    try:
        import resource
    except ImportError:                      # (Windows: no RLIMIT_NOFILE)
        return max_connections, None
    reserve = _open_files() + FILE_MARGIN + BACKLOG
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + reserve
    if soft != resource.RLIM_INFINITY and soft < need:
        want = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections, None
    bound = max(1, soft - reserve)
    return bound, (f"--max-connections {max_connections} lowered to {bound}: this process may open {soft} "
                   f"files (ulimit -n, hard limit {hard}) and keeps {reserve} for its own files and one "
                   f"accept burst; raise the limit to allow more")


class AcceptBackoff:
    """An event-loop exception handler that turns asyncio's traceback for each
    failed ``accept()`` (too many open files, no buffers) into one warning a
    minute; asyncio itself stops accepting for a second after each failure.
    Other errors go to the handler it replaces. ``failures`` counts them."""
    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float = 60.0):
        self.previous, self.interval, self.failures, self._warned = loop.get_exception_handler(), interval, 0, None
        loop.set_exception_handler(self)

    def __call__(self, loop, context) -> None:
        if context.get("message") != self.MESSAGE:
            if self.previous is not None:
                return self.previous(loop, context)
            return loop.default_exception_handler(context)
        self.failures += 1
        now = time.monotonic()
        if self._warned is None or now - self._warned >= self.interval:
            self._warned = now
            exc = context.get("exception")
            why = errno.errorcode.get(getattr(exc, "errno", None), "") or str(exc)
            print(f"minibatch-engine: warning: accept() failed ({why}: {getattr(exc, 'strerror', exc)}); "
                  f"new connections wait while asyncio retries each second ({self.failures} failures so far)",
                  file=sys.stderr, flush=True)


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The whole request body, or :class:`APIError` 408 if it is not all there within ``timeout`` s."""
    try:
        return await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout:g} s (the server's "
                       "--body-timeout)", status=408) from None


def _refusal() -> bytes:
    body = json.dumps(APIError(
        "the server is at its connection limit (--max-connections) and every connection is serving a "
        "request; retry later", status=503).body()).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class ConnectionGuard:
    """Keeps an aiohttp :class:`~aiohttp.web.Server` at ``limit`` open
    connections and closes one that sends no whole request head within
    ``header_timeout`` seconds of opening (the module doc). It wraps the
    server's ``connection_made``, which each new connection's handler calls.
    ``evicted``, ``refused`` and ``timed_out`` count what it did."""

    def __init__(self, server: web.Server, limit: int, header_timeout: float):
        self.server, self.limit, self.header_timeout = server, limit, header_timeout
        self.evicted = self.refused = self.timed_out = 0
        self._made = server.connection_made
        server.connection_made = self.connection_made

    def _first_head_due(self, handler) -> None:
        if handler.transport is not None and not getattr(handler, "_request_count", 1):
            self.timed_out += 1
            handler.force_close()

    def connection_made(self, handler, transport) -> None:
        open_ = [h for h in self.server.connections if h.transport is not None and not h.transport.is_closing()]
        self._made(handler, transport)
        asyncio.get_running_loop().call_later(self.header_timeout, self._first_head_due, handler)
        if len(open_) < self.limit:
            return
        idle = next((h for h in open_ if not getattr(h, "_request_in_progress", True)), None)
        if idle is not None:            # the oldest connection that is not serving a request
            self.evicted += 1
            idle.force_close()          # closes its transport
            return
        self.refused += 1
        transport.write(_refusal())     # sent before the close
        handler.force_close()


async def start_site(runner: web.AppRunner, host: str, port: int,
                     limits: ConnectionLimits) -> tuple[web.TCPSite, ConnectionGuard]:
    """Guard ``runner``'s server (set up by :func:`make_runner`) and listen on
    ``host:port``, the connection bound kept under the open-file limit."""
    bound, note = file_bounded(limits.max_connections)
    if note:
        print(f"minibatch-engine: {note}", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    if not isinstance(loop.get_exception_handler(), AcceptBackoff):
        AcceptBackoff(loop)
    guard = ConnectionGuard(runner.server, bound, limits.header_timeout)
    site = web.TCPSite(runner, host, port, backlog=BACKLOG)
    await site.start()
    return site, guard


def make_runner(app: web.Application, limits: ConnectionLimits, shutdown_timeout: float,
                handle_signals: bool = False) -> web.AppRunner:
    """An aiohttp runner with the header deadline, handler cancellation (a client
    that leaves cancels its handler) and no access log."""
    return web.AppRunner(app, handle_signals=handle_signals, handler_cancellation=True, access_log=None,
                         shutdown_timeout=shutdown_timeout, keepalive_timeout=limits.header_timeout)


def run_forever(app: web.Application, host: str, port: int, limits: ConnectionLimits,
                shutdown_timeout: float) -> None:
    """Serve ``app`` in the foreground until SIGTERM or SIGINT, then shut down
    gracefully (aiohttp's ``run_app``, with :class:`ConnectionGuard`)."""
    async def main():
        runner = make_runner(app, limits, shutdown_timeout, handle_signals=True)
        await runner.setup()
        try:
            try:
                await start_site(runner, host, port, limits)
            except OSError as e:                    # in use, not ours, no permission
                raise ValueError(f"cannot listen on --host {host} --port {port}: "
                                 f"{e.strerror or e}") from None
            await asyncio.Event().wait()            # until a signal raises GracefulExit
        finally:
            await runner.cleanup()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    task = loop.create_task(main())
    try:
        loop.run_until_complete(task)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    loop.run_until_complete(task)
        finally:
            rest = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in rest:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
    sys.stderr.flush()
