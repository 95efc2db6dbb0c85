"""``minibatch-engine serve``: OpenAI's HTTP API (as vLLM serves it) in front
of an :class:`~minibatch_engine.entrypoints.async_llm.AsyncLLM`.

* :mod:`.protocol`: request checks and response bodies;
* :mod:`.chat_template`: chat messages -> one prompt;
* :mod:`.metrics`: ``/metrics`` in Prometheus's format, vLLM's names;
* :mod:`.app`: the routes (aiohttp);
* :mod:`.tokenize_routes`: ``/tokenize``, ``/detokenize``, ``/tokenizer_info``;
* :mod:`.access`: the API key on ``/v1/*`` and CORS;
* :mod:`.errors`: failures answered in OpenAI's error shape (``serve`` and
  ``route`` both);
* :mod:`.launch`: the foreground server (signals) and :class:`ServerThread`.
* :mod:`.limits`: header and body deadlines and a bound on open connections
  (``serve`` and ``route`` both).
* :mod:`.json_flag`: flags that take a JSON object (``--kv-events-config``,
  ``--kv-transfer-config``), unknown keys refused by name.
* :mod:`.router_app`: ``minibatch-engine route``, an OpenAI-compatible router in
  front of several servers, with chapter 12's policies.

Needs the ``serve`` extra (``pip install minibatch-engine[serve]``).
"""
from .launch import ServerThread, make_app, serve

__all__ = ["ServerThread", "make_app", "serve"]
