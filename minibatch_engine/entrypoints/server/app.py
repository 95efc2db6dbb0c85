"""The HTTP routes: OpenAI's API as vLLM serves it, in front of an ``AsyncLLM``.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as
server-sent events with ``"stream": true``), ``GET /v1/models`` (``root``:
the model's folder, where its tokenizer files are), ``GET /health``,
``GET /metrics``, ``POST /reset_prefix_cache`` and the tokenizer
(:mod:`.tokenize_routes`); an API key and
CORS guard them as :mod:`.access` says. A request of ``n`` choices over ``p``
prompts becomes ``n * p`` engine requests (choice ``k`` seeded ``seed + k``),
as vLLM V1's front end fans a parallel-sampling request out. They reach the
engine in the same step, so each prefills the prompt: the prefix cache only
shares blocks computed in an earlier step. (The offline ``LLM`` prefills once
and forks the sequence instead.)

The handler is the only place that touches HTTP; the engine loop
(``AsyncLLM``) steps the engine in its own thread. A client that goes away
cancels its handler (aiohttp's ``handler_cancellation``), which closes its
streams, which abort their requests: their KV blocks are free before the
next step. A full waiting queue answers 503 with ``Retry-After``; a request
that could never fit under the bound (prompts x ``n`` above it) answers 400.

Admission is counted once and given back once, on every path: a request's
engine requests count as waiting from the moment the handler admits them
(:class:`Admission`) until each is in the engine's inbox, or until the handler
ends, however it ends (finished, refused, aborted, or a client that left before
the response headers went out).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from contextlib import aclosing
from typing import AsyncIterator

from aiohttp import web

from ..async_llm import AsyncLLM, StreamOutput
from ...core.inputs import encode_text
from . import kv_transfer, tokenize_routes
from .access import CorsPolicy, add_cors_headers, api_key_middleware, cors_middleware
from .chat_template import byte_level_chat
from .errors import error_middleware
from .limits import ConnectionLimits, read_body
from .metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from ...sampling.logits_process import with_bad_words
from .protocol import (APIError, GenerationRequest, choice, new_id, parse_json, parse_request, response,
                       usage)
from .request_fields import chat_logprobs, completion_logprobs, prompt_logprobs_json

LLM_KEY = web.AppKey("llm", AsyncLLM)
STATE_KEY = web.AppKey("state", dict)


def build_app(llm: AsyncLLM, model_name: str, max_waiting: int = 1024, chat_template=byte_level_chat,
              metrics: PrometheusStatLogger | None = None, shutdown_timeout: float = 30.0,
              limits: ConnectionLimits | None = None, api_keys: list[str] | None = None,
              cors: CorsPolicy | None = None, metrics_prefixes=("minibatch",),
              kv_transfer_config: "kv_transfer.KVTransferConfig | None" = None) -> web.Application:
    """The aiohttp application. ``llm``'s stat loggers get the Prometheus one.
    ``max_waiting``: a request that would make more than this many requests
    wait is refused with 503 (one that asks for more than this many at once,
    with 400). On shutdown the requests in flight get ``shutdown_timeout``
    seconds to finish, then are aborted, and the engine loop stops.
    ``limits``: the connection deadlines and bound (:mod:`.limits`).
    ``api_keys``, ``cors``: who may call it (:mod:`.access`);
    ``metrics_prefixes``: the metric names' prefixes (:mod:`.metrics`).
    ``kv_transfer_config``: P/D disaggregation (:mod:`.kv_transfer`); ``llm``
    must have been built with its connector."""
    if metrics is None:
        metrics = PrometheusStatLogger(model_name, metrics_prefixes, llm.engine.max_model_len)
    metrics.set_cache_config(llm.engine)
    llm.stat_loggers.append(metrics)
    guards = ([cors_middleware(cors)] if cors is not None else []) + \
        ([api_key_middleware(api_keys)] if api_keys else [])
    app = web.Application(middlewares=[*guards, error_middleware(refused=(ValueError, TypeError))])
    if cors is not None:
        app.on_response_prepare.append(add_cors_headers(cors))
    app[LLM_KEY] = llm
    app[STATE_KEY] = {"model": model_name, "max_waiting": max_waiting, "chat_template": chat_template,
                      "metrics": metrics, "created": int(time.time()), "in_flight": 0, "starting": 0,
                      "drain_timeout": shutdown_timeout, "limits": limits or ConnectionLimits(),
                      "kv_transfer": kv_transfer_config}
    if kv_transfer_config is not None:
        if llm.kv_connector is None:
            raise ValueError("kv_transfer_config needs an AsyncLLM built with its connector "
                             "(kv_transfer_config.connector_or_error())")
        kv_transfer.install(app, LLM_KEY, llm.kv_connector)
    app.add_routes([web.post("/v1/completions", _completions), web.post("/v1/chat/completions", _chat),
                    web.get("/v1/models", _models), web.get("/health", _health),
                    web.get("/metrics", _metrics), web.get("/version", _version),
                    web.post("/reset_prefix_cache", _reset_prefix_cache),
                    *tokenize_routes.routes(LLM_KEY, STATE_KEY)])
    app.on_shutdown.append(_drain)
    app.on_cleanup.append(_shutdown)
    return app


async def _drain(app: web.Application) -> None:
    """Let the requests in flight finish for up to ``drain_timeout`` seconds, then abort the rest."""
    st = app[STATE_KEY]
    deadline = time.monotonic() + st["drain_timeout"]
    while st["in_flight"] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    st["aborted_at_shutdown"] = app[LLM_KEY].abort_all()


async def _shutdown(app: web.Application) -> None:
    await app[LLM_KEY].shutdown()


# --- small routes --------------------------------------------------------------------
async def _models(request):
    st, llm = request.app[STATE_KEY], request.app[LLM_KEY]
    card = {"id": st["model"], "object": "model", "created": st["created"], "owned_by": "minibatch-engine",
            "root": tokenize_routes.model_folder(llm) or st["model"],     # where AutoTokenizer finds the files
            "parent": None, "max_model_len": _limit(llm)}
    return web.json_response({"object": "list", "data": [card]})


async def _health(request):
    if request.app[LLM_KEY]._error is not None:
        return web.json_response(APIError("the engine loop has failed", status=503).body(), status=503)
    return web.Response(status=200)


async def _reset_prefix_cache(request):
    """vLLM's ``POST /reset_prefix_cache``: forget the prefix cache (``reset``:
    false while requests hold blocks); KV-event subscribers see AllBlocksCleared."""
    return web.json_response({"reset": await request.app[LLM_KEY].reset_prefix_cache()})


async def _version(request):
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("minibatch-engine")
    except PackageNotFoundError:            # run from a source tree
        v = "unknown"
    return web.json_response({"version": v})


async def _metrics(request):
    st = request.app[STATE_KEY]
    stats = request.app[LLM_KEY].scheduler_stats()          # waiting: admitted by a handler counts too
    st["metrics"].set_gauges(dataclasses.replace(stats, num_waiting_reqs=stats.num_waiting_reqs + st["starting"]))
    return web.Response(body=st["metrics"].exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


# --- generation ----------------------------------------------------------------------
async def _completions(request):
    return await _generate(request, chat=False)


async def _chat(request):
    return await _generate(request, chat=True)


def _limit(llm: AsyncLLM) -> int:
    eng = llm.engine
    return min(eng.max_model_len, eng.kv_cache.max_tokens_per_request())


async def _read(request, chat: bool) -> tuple[GenerationRequest, dict]:
    raw = await read_body(request, request.app[STATE_KEY]["limits"].body_timeout)
    body = parse_json(raw)
    return parse_request(body, chat), body


def _encode(llm: AsyncLLM, req: GenerationRequest, template) -> list[list[int]]:
    """Every prompt as token ids, checked against the vocabulary and the context length."""
    texts = [template(req.messages, add_generation_prompt=req.add_generation_prompt)] if req.chat \
        else req.prompts
    vocab, limit, out = llm.engine.model_config.vocab_size, _limit(llm), []
    for i, p in enumerate(texts):
        param = "messages" if req.chat else "prompt"
        if isinstance(p, str):
            if llm.tokenizer is None:
                raise APIError("this model has no tokenizer: send token ids", param)
            try:
                ids = encode_text(llm.tokenizer, p, param)
            except (TypeError, ValueError) as e:
                raise APIError(str(e), param) from None
        else:
            ids = p
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(f"prompt token ids must be in [0, {vocab}), got {bad[:3]}", param)
        if not ids:
            raise APIError("the prompt is empty", param)
        k = req.params.truncate_prompt_tokens           # vLLM's: keep the last k tokens (-1: all that fit)
        if k is not None:
            ids = ids[-max(1, limit - req.params.max_tokens if k == -1 else k):]
        room = limit - len(ids)
        if room < 1 or (req.max_tokens_given and req.params.max_tokens > room):
            raise APIError(f"this model's maximum context length is {limit} tokens; the prompt has {len(ids)} "
                           f"and max_tokens asks for {req.params.max_tokens if req.max_tokens_given else 1} "
                           "more", "max_tokens" if room >= 1 else param)
        out.append(ids)
    return out


async def _generate(request, chat: bool):
    app, llm = request.app, request.app[LLM_KEY]
    st = app[STATE_KEY]
    req, body = await _read(request, chat)
    if req.model is not None and req.model != st["model"]:
        raise APIError(f"The model `{req.model}` does not exist.", "model", 404)
    if req.params.stop and llm.tokenizer is None:
        raise APIError("'stop' needs a tokenizer, and this model has none: use stop_token_ids", "stop")
    try:
        req.params = with_bad_words(req.params, llm.tokenizer, "bad_words")
    except ValueError as e:
        raise APIError(str(e), "bad_words") from None
    if req.params.structured_outputs is not None:   # compiled now (and cached): a bad grammar is a 400 by name
        try:
            llm.engine.check_grammar(req.params)
        except ValueError as e:
            field = req.structured_field
            raise APIError(str(e) if field == "structured_outputs" else f"{e} (asked for by '{field}')",
                           field) from None
    transfer = kv_transfer.plan(body, req, llm.kv_connector if st["kv_transfer"] is not None else None)
    prompts = _encode(llm, req, st["chat_template"])
    if llm._error is not None:
        raise APIError("the engine loop has failed", status=503)
    wanted, bound = len(prompts) * req.n, st["max_waiting"]
    if wanted > bound:                           # never admissible: a retry would loop for ever
        raise APIError(f"this request asks for {len(prompts)} prompt(s) x n={req.n} = {wanted} sequences, "
                       f"more than this server ever lets wait (--max-waiting-requests {bound}): send fewer "
                       "prompts or a smaller n", "n" if req.n > 1 else "prompt")
    waiting = llm.num_waiting + st["starting"]
    if waiting + wanted > bound:
        raise APIError(f"the server is busy: {waiting} requests are waiting (the bound is "
                       f"{bound}); retry later", status=503)
    if not req.max_tokens_given:               # chat: the room left (vLLM's default); completions: 16 if it fits
        room = _limit(llm) - max(len(p) for p in prompts)
        req.params = dataclasses.replace(req.params, max_tokens=room if chat else min(16, room))
    rid = new_id(chat)
    jobs = [(i * req.n + k, ids, req.choice_params(k)) for i, ids in enumerate(prompts) for k in range(req.n)]
    fields = None
    st["in_flight"] += 1
    admission = Admission(st, len(jobs))
    try:
        if transfer is not None and transfer.remote_prefill:      # a decode replica: the prompt's K/V first
            kv = await kv_transfer.pull(transfer, prompts[0], llm.kv_connector, st["kv_transfer"].pull_timeout_s)
            jobs = [(*jobs[0], {"load": kv})]
        elif transfer is not None:                                # a prefill replica: pin the prompt's K/V
            jobs = [(*jobs[0], {"pin": True})]
            fields = lambda: {kv_transfer.PARAM: kv_transfer.response_params(     # noqa: E731
                request, st["kv_transfer"], llm.kv_connector, f"{rid}-0")}
        if req.stream:
            return await _stream(request, req, rid, prompts, jobs, st, admission)
        return await _whole(req, rid, prompts, jobs, st, llm, admission, fields)
    finally:
        admission.release()
        st["in_flight"] -= 1


def _decoder(llm: AsyncLLM):
    """Token ids -> text: a token's name in the logprobs fields, or a prompt's
    text. A lone token whose text is not valid UTF-8 (one byte of a character)
    and every token of a model without a tokenizer are named ``token_id:N``, as
    vLLM names tokens with ``return_tokens_as_token_ids``: distinct tokens keep
    distinct names."""
    if llm.tokenizer is None:
        return lambda ids: "".join(f"token_id:{t}" for t in ids)
    decode = llm.tokenizer.decode

    def name(ids):
        text = decode(ids)
        return f"token_id:{ids[0]}" if len(ids) == 1 and (not text or "\ufffd" in text) else text
    return name


def _prompt_text(req, prompts, i: int, decode) -> str:
    """The echoed prompt of choice ``i``: the text sent, or its token ids decoded."""
    p = req.prompts[i // req.n]
    return p if isinstance(p, str) and req.params.truncate_prompt_tokens is None else decode(prompts[i // req.n])


def _logprobs_json(req, prompts, i: int, ids: list, entries: list, prompt_entries, decode, offset=0):
    """A choice's ``logprobs`` in the endpoint's shape (None when not asked for)."""
    if req.params.logprobs is None:
        return None
    n = req.params.logprobs
    if req.chat:
        return chat_logprobs(entries, n, decode)
    if req.echo and prompt_entries is not None:
        ids, entries = list(prompts[i // req.n]) + ids, list(prompt_entries) + entries
    return completion_logprobs(ids, entries, n, decode, offset)


class Admission:
    """Engine requests a handler admitted that are not yet in the engine's inbox
    (``state["starting"]``): they count toward ``max_waiting``. Each is given
    back exactly once: by :meth:`submitted` when its stream puts it in the inbox
    (from then on ``AsyncLLM.num_waiting`` counts it), or by :meth:`release`
    when the handler ends, whatever way it ends."""

    def __init__(self, state: dict, n: int):
        self.state, self.left = state, n
        state["starting"] += n

    def submitted(self) -> None:
        if self.left:
            self.left -= 1
            self.state["starting"] -= 1

    def release(self) -> None:
        self.state["starting"] -= self.left
        self.left = 0


async def _merged(llm: AsyncLLM, rid: str, jobs, priority: int,
                  admission: Admission) -> AsyncIterator[tuple[int, StreamOutput]]:
    """Every choice's outputs as they come, tagged with the choice's index.
    Leaving early (or being cancelled) cancels every choice's stream; close it
    (``aclosing``) so that happens at once, not when it is garbage-collected."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, ids, params, transfer=None):
        try:
            extra = {} if transfer is None else {"kv_transfer": transfer}
            outs = llm.stream(ids, params, request_id=f"{rid}-{index}", priority=priority, **extra)
            admission.submitted()               # the first step of the loop below puts it in the inbox,
            async for out in outs:              # with no await in between: the count stays exact
                queue.put_nowait((index, out))
        except Exception as e:                  # noqa: BLE001  (handed to the consumer)
            queue.put_nowait((index, e))
    tasks = [asyncio.create_task(pump(*job)) for job in jobs]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            left -= item.finished
            yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _whole(req, rid, prompts, jobs, st, llm, admission, fields=None):
    """The whole response at once; ``fields()``, if given, adds top-level fields
    once every choice has finished (a prefill replica's ``kv_transfer_params``)."""
    model = st["model"]
    texts, counts, reasons, ids, entries, prompt_entries = {}, {}, {}, {}, {}, {}
    async with aclosing(_merged(llm, rid, jobs, req.priority, admission)) as outs:
        async for i, out in outs:
            if out.prompt_logprobs is not None:
                prompt_entries[i] = out.prompt_logprobs
            if out.finished:
                reasons[i] = "length" if req.echo_only and out.finish_reason == "stop" else out.finish_reason
            if req.echo_only:                   # the one token computed is not part of the reply
                continue
            texts[i] = texts.get(i, "") + (out.text or "")
            counts[i] = counts.get(i, 0) + (out.token_id is not None)
            if out.token_id is not None:
                ids.setdefault(i, []).append(out.token_id)
                entries.setdefault(i, []).append(out.logprobs)
    decode = _decoder(llm)
    choices = []
    for i in range(len(jobs)):
        text = texts.get(i, "")
        if req.echo:
            text = _prompt_text(req, prompts, i, decode) + text
        c = choice(i, text, reasons.get(i), req.chat,
                   logprobs=_logprobs_json(req, prompts, i, ids.get(i, []), entries.get(i, []),
                                           prompt_entries.get(i), decode))
        if req.params.prompt_logprobs is not None and i in prompt_entries:
            c["prompt_logprobs"] = prompt_logprobs_json(prompt_entries[i], decode)
        choices.append(c)
    out = response(rid, model, choices, req.chat, usage_=usage(sum(map(len, prompts)), sum(counts.values())))
    if fields is not None:
        out.update(fields())
    return web.json_response(out)


async def _stream(request, req, rid, prompts, jobs, st, admission):
    """Server-sent events, one chunk per token. A client that leaves at any
    point (before the headers, mid-stream, before ``[DONE]``) ends it quietly:
    its streams close, which aborts their requests; it is not a server error.
    A choice that fails in its own step ends with ``finish_reason`` "error",
    followed by an error event that says why (the other choices go on)."""
    model = st["model"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    created, tokens = int(time.time()), 0
    decode, offsets = _decoder(request.app[LLM_KEY]), {}

    prompt_tokens = sum(map(len, prompts))

    async def send(obj) -> None:
        if req.continuous_usage and obj.get("choices"):      # vLLM's continuous_usage_stats
            obj["usage"] = usage(prompt_tokens, tokens)
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
    try:
        await resp.prepare(request)
        if req.chat:                             # vLLM's first chunk: the role, no content
            await send(response(rid, model, [choice(i, "", None, True, delta=True, first=True)
                                             for i in range(len(jobs))], True, chunk=True, created=created))
        try:
            async with aclosing(_merged(request.app[LLM_KEY], rid, jobs, req.priority, admission)) as outs:
                async for i, out in outs:
                    if req.echo_only:                    # max_tokens 0: the one token computed is not sent
                        out = dataclasses.replace(out, token_id=None, text="", logprobs=None, finish_reason=(
                            "length" if out.finish_reason == "stop" else out.finish_reason))
                    tokens += out.token_id is not None
                    if req.echo and i not in offsets:        # the prompt first, as vLLM streams an echo
                        text = _prompt_text(req, prompts, i, decode)
                        lps = _logprobs_json(req, prompts, i, [], [], out.prompt_logprobs, decode)
                        offsets[i] = len(text)
                        await send(response(rid, model, [choice(i, text, None, False, logprobs=lps)], False,
                                            chunk=True, created=created))
                    if out.token_id is not None or out.finished:     # one chunk per token, as vLLM streams
                        lps = None
                        if out.token_id is not None and out.logprobs is not None:
                            lps = _logprobs_json(req, prompts, i, [out.token_id], [out.logprobs], None,
                                                 decode, offsets.get(i, 0))
                            offsets[i] = offsets.get(i, 0) + len(out.text or "")
                        await send(response(rid, model, [choice(i, out.text or "", out.finish_reason, req.chat,
                                                                delta=True, logprobs=lps)], req.chat,
                                            chunk=True, created=created))
                    if out.finish_reason == "error":     # that choice failed in its own step: say why
                        await send(APIError(f"choice {i}: {out.error}", status=500).body())
        except (ValueError, TypeError) as e:     # refused by the engine after the headers went out
            await send(APIError(str(e)).body())
        if req.include_usage:
            await send(response(rid, model, [], req.chat, chunk=True, created=created,
                                usage_=usage(prompt_tokens, tokens)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:                 # the client left: nothing more to send, nothing to log
        pass
    return resp
