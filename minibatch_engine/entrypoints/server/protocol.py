"""OpenAI's request and response bodies, as vLLM serves them: parsing and
checking a request, and building the JSON a client expects back.

Every check names the field it refuses (``APIError.param``), and the server
answers it with HTTP 400 and OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``, with the HTTP status in
``code`` as vLLM does (OpenAI's own ``code`` is a string or null, and its
``type`` values differ). Fields OpenAI or vLLM define but
this engine does not implement (``suffix``, ``tools``, ``use_beam_search``, ...)
are refused by name when set, never silently ignored
(:mod:`.request_fields`, which also reads the sampling extensions and
log-probabilities); fields nobody defines are ignored, as OpenAI's own server
does.
"""
from __future__ import annotations

import json
import math
import sys
import time
import uuid
from dataclasses import dataclass, field

from ...core.request import check_priority
from ...sampling.params import SamplingParams
from .request_fields import refuse_unimplemented, sampling_fields, structured_fields

MAX_N = 128                     # most choices per request


class APIError(Exception):
    """An error with its HTTP status, answered in OpenAI's error shape."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 408: "timeout_error",
             500: "internal_server_error", 502: "server_error", 503: "service_unavailable_error"}

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


@dataclass
class GenerationRequest:
    """A checked request of either endpoint. ``prompts`` are text or token ids
    (chat: one, the rendered conversation); ``params`` is choice 0's
    :class:`SamplingParams` (choice k is seeded ``seed + k``)."""
    model: str | None
    prompts: list
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    priority: int
    max_tokens_given: bool
    chat: bool = False
    messages: list = field(default_factory=list)
    echo: bool = False                   # completions: the prompt leads the text (and its logprobs)
    add_generation_prompt: bool = True   # chat: the template opens the assistant's turn
    continuous_usage: bool = False       # stream_options.continuous_usage_stats: usage in every chunk
    echo_only: bool = False              # completions: echo with max_tokens 0, the prompt alone (OpenAI's scoring)
    structured_field: str | None = None  # the field that asked for structured output (named in its errors)

    def choice_params(self, k: int) -> SamplingParams:
        """Sampling for choice ``k`` of a prompt: vLLM's n > 1 rule, seed + k."""
        import dataclasses
        p = self.params
        return p if k == 0 or p.seed is None else dataclasses.replace(p, seed=p.seed + k)


def parse_json(raw: bytes):
    """A request body as JSON; :class:`APIError` (400) naming what is wrong with
    it: not JSON, nested too deeply for the parser, or an integer too long to
    read (Python converts at most ``sys.get_int_max_str_digits()`` digits)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError("the request body's JSON is nested too deeply to read") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e})") from None
    except ValueError:                      # int('9' * 5000): past Python's conversion limit
        raise APIError(f"the request body has an integer of more than {sys.get_int_max_str_digits()} "
                       "digits") from None


def _int(body: dict, name: str, default, low: int | None = None, high: int | None = None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or (low is not None and v < low) or \
            (high is not None and v > high):
        rng = f" >= {low}" if high is None else f" in [{low}, {high}]"
        raise APIError(f"'{name}' must be an integer{rng if low is not None else ''}, got {v!r}", name)
    return v


def _priority(body: dict) -> int:
    """The engine's own check (:func:`~minibatch_engine.core.request.check_priority`), as a 400."""
    v = body.get("priority")
    try:
        return 0 if v is None else check_priority(v, "'priority'")
    except (TypeError, ValueError) as e:
        raise APIError(str(e), "priority") from None


def _float(body: dict, name: str, default: float, ok, what: str) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
        raise APIError(f"'{name}' must be {what}, got {v!r}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _prompts(body: dict) -> list:
    """``prompt``: a string, a list of strings, a list of token ids, or a list of those lists."""
    p = body.get("prompt")
    bad = APIError("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                   f"token-id lists, got {type(p).__name__}", "prompt")
    if isinstance(p, str):
        return [p]
    if not isinstance(p, list) or not p:
        raise bad if p is not None else APIError("'prompt' is required", "prompt")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [list(p)]
    if all(isinstance(x, str) for x in p) or all(
            isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
        return list(p)
    raise bad


def _messages(body: dict) -> list[dict]:
    """``messages``: a non-empty list of ``{"role", "content"}``; content is text
    or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"'{where}' must be an object with 'role' and 'content'", where)
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "developer", "user", "assistant"):
            raise APIError(f"'{where}.role' must be system, developer, user or assistant, got {role!r}",
                           f"{where}.role")
        if isinstance(content, list):
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise APIError(f"'{where}.content': only text parts ({{'type': 'text', 'text': ...}}) "
                               "are supported", f"{where}.content")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise APIError(f"'{where}.content' must be a string or a list of text parts", f"{where}.content")
        out.append({"role": role, "content": content})
    return out


def parse_request(body, chat: bool) -> GenerationRequest:
    """Check a request body of ``/v1/completions`` (``chat=False``) or
    ``/v1/chat/completions``; raise :class:`APIError` naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(f"'model' must be a string, got {model!r}", "model")
    refuse_unimplemented(body, chat, APIError)
    extra, echo, add_generation_prompt = sampling_fields(body, chat, APIError)
    extra["structured_outputs"], structured_field = structured_fields(body, APIError)
    messages = _messages(body) if chat else []
    prompts = [] if chat else _prompts(body)
    mt_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, mt_name, None, 0)
    # OpenAI's legacy scoring request (vLLM's too): echo with max_tokens 0 returns the prompt and
    # its log-probabilities alone. The engine still computes one token; the reply leaves it out.
    echo_only = echo and max_tokens == 0
    if max_tokens == 0 and not echo_only:
        hint = "" if chat else " (0 only with 'echo': true)"
        raise APIError(f"'{mt_name}' must be an integer >= 1{hint}, got 0", mt_name)
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError("'best_of' is not supported (it may only equal n)", "best_of")
    top_k = _int(body, "top_k", 0, -1)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise APIError("'stop' must be a non-empty string or a list of up to 16 of them", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in stop_ids):
        raise APIError("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise APIError("'stream_options' must be an object", "stream_options")
    stream = _bool(body, "stream", False)
    include_usage = _bool(opts or {}, "include_usage", False)
    # vLLM's extension: every chunk carries the usage so far (with include_usage, as vLLM reads it)
    continuous_usage = include_usage and _bool(opts or {}, "continuous_usage_stats", False)
    if opts is not None and not stream:
        raise APIError("'stream_options' is only allowed with 'stream': true", "stream_options")
    try:
        params = SamplingParams(
            # the caller replaces an absent chat max_tokens with the room left
            max_tokens=1 if echo_only else max_tokens or 16,
            temperature=_float(body, "temperature", 1.0, lambda v: v >= 0, "a number >= 0"),
            top_p=_float(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
            top_k=max(0, top_k), seed=_int(body, "seed", None, 0, 2**63 - MAX_N),
            stop=tuple(stop), stop_token_ids=tuple(stop_ids), ignore_eos=_bool(body, "ignore_eos", False),
            **extra)
    except ValueError as e:                # the message names SamplingParams.<field>: the field is the param
        name = str(e).split("SamplingParams.", 1)[-1].split(" ", 1)[0] if "SamplingParams." in str(e) else None
        raise APIError(str(e).replace("SamplingParams.", ""), name) from None
    return GenerationRequest(model, prompts, params, n, stream, include_usage,
                             _priority(body), max_tokens is not None, chat, messages,
                             echo, add_generation_prompt, continuous_usage, echo_only,
                             structured_field)


# --- responses ------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(index: int, text: str, finish_reason: str | None, chat: bool, delta: bool = False,
           first: bool = False, logprobs: dict | None = None) -> dict:
    """One choice of a response (``delta``: of a streamed chunk); ``logprobs``
    in the endpoint's shape (:mod:`.request_fields`)."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if delta:
        msg = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": msg, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def response(rid: str, model: str, choices: list, chat: bool, chunk: bool = False,
             usage_: dict | None = None, created: int | None = None) -> dict:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    out = {"id": rid, "object": obj, "created": created or int(time.time()), "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        out["usage"] = usage_
    return out
