"""Starting a server: ``minibatch-engine serve`` (the foreground, with signals)
or :class:`ServerThread` (in the background of this process: tests, notebooks).

SIGTERM (or Ctrl-C) drains: the server stops accepting connections, lets the
requests in flight finish for up to ``shutdown_timeout`` seconds, then aborts
what is left (their KV memory goes back), stops the engine loop and exits 0,
printing what it drained and what it aborted.

Both run with the application's :class:`~.limits.ConnectionLimits` (header
and body deadlines, a bound on open connections), kept in its state.
"""
from __future__ import annotations

import asyncio
import sys
import threading

from aiohttp import web

from ..async_llm import AsyncLLM
from .app import LLM_KEY, STATE_KEY, build_app
from .chat_template import load_chat_template
from .limits import ConnectionLimits, make_runner, run_forever, start_site
from .memory import limit_malloc_arenas

DEFAULT_HISTORY = 4096      # steps of trace a server keeps (bounded memory: AsyncLLM's history)


def make_app(model="tiny", served_model_name: str | None = None, max_waiting: int = 1024,
             chat_template: str | None = None, history: int | None = DEFAULT_HISTORY,
             limits: ConnectionLimits | None = None, api_keys: list[str] | None = None,
             cors=None, metrics_prefixes=("minibatch",), kv_events_config=None,
             kv_transfer_config=None, **llm_options) -> web.Application:
    """Build the model, an :class:`AsyncLLM` around it and the application.
    ``llm_options`` are AsyncLLM's (``device``, ``dtype``, engine options).
    The chat template is read (and its syntax checked) before the model is built.
    ``api_keys``, ``cors`` (a :class:`~.access.CorsPolicy`) and
    ``metrics_prefixes`` go to :func:`~.app.build_app`. ``kv_events_config``
    (vLLM's ``--kv-events-config``: JSON, a dict or a
    :class:`~.kv_events.KVEventsConfig`) publishes the prefix cache's events.
    ``kv_transfer_config`` (vLLM's ``--kv-transfer-config``: JSON, a dict or a
    :class:`~.kv_transfer.KVTransferConfig`) makes it a prefill or decode replica."""
    from .metrics import check_prefixes
    check_prefixes(metrics_prefixes)           # a bad flag fails before the model loads
    limit_malloc_arenas()                      # before the engine loop's thread starts (.memory)
    if served_model_name is not None and not (isinstance(served_model_name, str) and served_model_name.strip()):
        raise ValueError(f"--served-model-name must be a non-empty name, got {served_model_name!r}")
    source = model if isinstance(model, str) else None
    template = load_chat_template(source, chat_template) if chat_template is not None else None
    transfer = connector = None
    if kv_transfer_config is not None:
        from .kv_transfer import KVTransferConfig
        transfer = kv_transfer_config if isinstance(kv_transfer_config, KVTransferConfig) \
            else KVTransferConfig.parse(kv_transfer_config)     # a bad config fails before the model loads
        connector = transfer.connector_or_error()
    publisher = None
    if kv_events_config is not None:
        from .kv_events import KVEventsConfig, make_publisher
        cfg = KVEventsConfig.parse(kv_events_config) if not isinstance(kv_events_config, KVEventsConfig) \
            else kv_events_config          # a bad config fails before the model loads
        publisher = make_publisher(cfg) if cfg.active else None
    try:
        llm = AsyncLLM(model, history=history, kv_event_publisher=publisher, kv_connector=connector, **llm_options)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    name = served_model_name or (model if isinstance(model, str) else llm.model.config.name)
    if template is None:
        template = load_chat_template(getattr(llm.model, "source", None))
    app = build_app(llm, name, max_waiting=max_waiting, chat_template=template, limits=limits,
                    api_keys=api_keys, cors=cors, metrics_prefixes=metrics_prefixes, kv_transfer_config=transfer)
    if publisher is not None:
        async def close_publisher(app):
            publisher.close()
        app.on_cleanup.append(close_publisher)
    return app


def _log(msg: str) -> None:
    print(f"minibatch-engine serve: {msg}", file=sys.stderr, flush=True)


def _on_shutdown_report(app: web.Application) -> None:
    async def draining(app):
        st = app[STATE_KEY]
        _log(f"shutting down: {st['in_flight']} HTTP requests in flight get {st['drain_timeout']:g} s to finish")

    async def done(app):
        eng = app[LLM_KEY].engine
        left = sum(not r.is_finished for r in eng.requests.values())
        _log(f"aborted {app[STATE_KEY].get('aborted_at_shutdown', 0)} streams still running after the drain")
        _log(f"stopped: {left} engine requests unfinished, {eng.kv_cache.num_used_blocks} KV blocks held")
    app.on_shutdown.insert(0, draining)    # before build_app's drain
    app.on_cleanup.append(done)            # after build_app's own cleanup (the engine's shutdown)


def serve(app: web.Application, host: str = "127.0.0.1", port: int = 8000,
          shutdown_timeout: float = 30.0) -> None:
    """Run in the foreground until SIGTERM or SIGINT (the module doc)."""
    _on_shutdown_report(app)
    st = app[STATE_KEY]
    st["drain_timeout"] = shutdown_timeout
    _log(f"serving {st['model']!r} on http://{host}:{port}/v1")
    run_forever(app, host, port, st["limits"], shutdown_timeout)


class ServerThread:
    """A server in a background thread of this process, with its own event
    loop: ``with ServerThread(app, port=0) as s: s.url``. ``port=0`` picks a
    free port. Leaving the block shuts it down as SIGTERM would."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0,
                 shutdown_timeout: float = 5.0):
        self.app, self.host, self.port, self.shutdown_timeout = app, host, port, shutdown_timeout
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="minibatch-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def llm(self) -> AsyncLLM:
        return self.app[LLM_KEY]

    def start(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            state = self.app.get(STATE_KEY, {})      # (any aiohttp application will do)
            state["drain_timeout"] = self.shutdown_timeout
            limits = state.get("limits", ConnectionLimits())
            self.runner = make_runner(self.app, limits, self.shutdown_timeout)
            self.loop.run_until_complete(self.runner.setup())
            site, self.guard = self.loop.run_until_complete(start_site(self.runner, self.host, self.port, limits))
            self.port = site._server.sockets[0].getsockname()[1]
        except BaseException as e:          # noqa: BLE001  (reported by start())
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def call(self, coro, timeout: float | None = 30):
        """Run a coroutine on the server's loop (e.g. to read engine state between steps)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
