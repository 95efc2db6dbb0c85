"""The request fields beyond the basic ones: vLLM's sampling extensions,
log-probabilities and ``echo``, structured output, and every known field
this server does not implement, refused by name.

Fields OpenAI or vLLM define are either honoured or refused with HTTP 400
naming the field; never accepted and ignored (a client that asks for JSON
output and silently gets free text is worse off than one told no). Fields
nobody defines are ignored, as OpenAI's own server does.

Log-probabilities in the response (:func:`completion_logprobs`,
:func:`chat_logprobs`) take OpenAI's shapes as vLLM fills them: the raw model
distribution (vLLM's default ``logprobs_mode``), at most
:data:`MAX_LOGPROBS` alternatives per token, ``-inf`` sent as ``-9999.0``
(JSON has no infinity).

Structured output (:func:`structured_fields`) comes in three spellings, one
per request: OpenAI's ``response_format`` (``json_object``, or ``json_schema``
with ``json_schema.schema``), vLLM's ``structured_outputs`` object (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``), and vLLM's older
``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``.
"""
from __future__ import annotations

import math

from ...sampling.logprobs import as_dicts
from ...sampling.structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20               # vLLM's default --max-logprobs

# Known fields not implemented: refused when set to anything but these "off" values.
REFUSED_BOTH = {
    "suffix": (None, ""), "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "early_stopping": (None, False), "allowed_token_ids": (None,),
    "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "logits_processors": (None,), "prompt_embeds": (None,),
    "return_tokens_as_token_ids": (None, False), "return_token_ids": (None, False),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "add_special_tokens": (None, False), "vllm_xargs": (None,), "mm_processor_kwargs": (None,),
    "cache_salt": (None,), "request_id": (None,), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "service_tier": (None, "auto", "default"),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "web_search_options": (None,), "reasoning_effort": (None,), "store": (None, False),
    "best_of": (None,),            # checked against n by the protocol
}
REFUSED_CHAT = {"echo": (None, False), "chat_template": (None,), "chat_template_kwargs": (None, {}),
                "continue_final_message": (None, False), "documents": (None,),
                "prompt_logprobs": (None,)}
# Accepted and ignored: "include_reasoning" (vLLM's default is true; with no reasoning parser
# there is no reasoning to include or leave out; vllm-router's P/D mode sends it set to true).
REFUSED_COMPLETIONS = {"top_logprobs": (None,)}


def refuse_unimplemented(body: dict, chat: bool, error) -> None:
    """Raise ``error(message, field)`` for the first known field set that is not implemented."""
    for table in (REFUSED_BOTH, REFUSED_CHAT if chat else REFUSED_COMPLETIONS):
        for name, off in table.items():
            if name == "best_of":
                continue
            if name in body and not any(body[name] == v and type(body[name]) is type(v) or
                                        (body[name] is None and v is None) for v in off):
                raise error(f"'{name}' is not supported by this server{_hint(name)}", name)


def _hint(name: str) -> str:
    if name == "guided_decoding_backend":
        return " (structured output always runs on xgrammar)"
    if name == "guided_whitespace_pattern":
        return " (structured_outputs.disable_any_whitespace chooses fixed or free JSON whitespace)"
    if name == "skip_special_tokens":
        return " with false (special tokens are always skipped)"
    if name == "chat_template_kwargs":
        return " (the model's template takes no arguments here; add_generation_prompt is a field of its own)"
    return ""


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
JSON_SCHEMA_FORMAT = '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'


def structured_fields(body: dict, error) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structured output and the field that asked for it (None,
    None: free text). At most one field may ask; each is checked here, and the
    grammar itself when it is compiled (the handler names this field then too)."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise error("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        f"{JSON_SCHEMA_FORMAT}, got {fmt!r}", "response_format")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise error(f"'response_format' of type json_schema needs a schema object: {JSON_SCHEMA_FORMAT}",
                            "response_format")
            found.append(("response_format", {"json": schema}))
    if body.get("structured_outputs") is not None:
        if not isinstance(body["structured_outputs"], dict):
            raise error("'structured_outputs' must be an object with one of json, regex, choice, grammar, "
                        "json_object", "structured_outputs")
        found.append(("structured_outputs", body["structured_outputs"]))
    found += [(name, {kind: body[name]}) for name, kind in GUIDED.items() if body.get(name) is not None]
    if len(found) > 1:
        raise error(f"ask for structured output once: {', '.join(n for n, _ in found)} are all set",
                    found[1][0])
    if not found:
        return None, None
    name, spec = found[0]
    try:
        return StructuredOutputsParams.of(spec), name
    except ValueError as e:
        what = "structured_outputs" if name == "structured_outputs" else f"structured_outputs.{next(iter(spec))}"
        raise error(str(e).replace(f"SamplingParams.{what}", name), name) from None


def sampling_fields(body: dict, chat: bool, error) -> tuple[dict, bool, bool]:
    """``SamplingParams`` keyword arguments from the extension fields, plus
    ``echo`` and ``add_generation_prompt``. Range checks are the
    ``SamplingParams``'s (its messages name the field); types are checked here."""
    kw: dict = {}

    def number(name, default):
        v = body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise error(f"'{name}' must be a number, got {v!r}", name)
        return float(v)

    def integer(name):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise error(f"'{name}' must be an integer, got {v!r}", name)
        return v

    def flag(name, default):
        v = body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise error(f"'{name}' must be true or false, got {v!r}", name)
        return v

    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0), ("min_p", 0.0)):
        kw[name] = number(name, default)
    kw["min_tokens"] = integer("min_tokens") or 0
    kw["truncate_prompt_tokens"] = integer("truncate_prompt_tokens")
    kw["include_stop_str_in_output"] = flag("include_stop_str_in_output", False)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise error(f"'logit_bias' must map token ids to biases, got {bias!r}", "logit_bias")
        try:
            kw["logit_bias"] = {int(k): v for k, v in bias.items()} or None
        except ValueError:
            raise error("'logit_bias' keys must be token ids (integers, as strings in JSON)",
                        "logit_bias") from None
    words = body.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise error("'bad_words' must be a list of strings", "bad_words")
        kw["bad_words"] = tuple(words)
    if chat:
        wants = flag("logprobs", False)
        top = integer("top_logprobs")
        if top is not None and not wants:
            raise error("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise error(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
        kw["logprobs"] = (top or 0) if wants else None
        echo = False
    else:
        n = integer("logprobs")
        if n is not None and not 0 <= n <= MAX_LOGPROBS:
            raise error(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {n}", "logprobs")
        kw["logprobs"] = n
        echo = flag("echo", False)
        pl = integer("prompt_logprobs")
        if pl is not None and not 0 <= pl <= MAX_LOGPROBS:
            raise error(f"'prompt_logprobs' must be in [0, {MAX_LOGPROBS}], got {pl}", "prompt_logprobs")
        if echo and n is not None:              # echoed prompt tokens come with their logprobs
            pl = max(n, pl or 0)
        kw["prompt_logprobs"] = pl
    return kw, echo, flag("add_generation_prompt", True)


# --- responses ------------------------------------------------------------------------
def _lp(v: float) -> float:
    return max(v, -9999.0)


def _tokens(entries, n: int):
    """(token id, logprob, [(id, logprob)] of the top n) per entry."""
    for ids, lps, _rank in entries:
        yield ids[0], lps[0], list(zip(ids[1:1 + n], lps[1:1 + n]))


def completion_logprobs(token_ids, entries, n: int, decode, offset: int = 0) -> dict:
    """``/v1/completions``' ``logprobs`` for ``token_ids`` (one entry each):
    ``tokens``, ``token_logprobs``, ``top_logprobs`` (the top n, and the token
    itself, as vLLM gives them) and ``text_offset`` (where each token's text
    starts, counting from ``offset``). An entry None (the first echoed prompt
    token: nothing precedes it) gives null."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    pos = offset
    for tok, e in zip(token_ids, entries):
        text = decode([tok])
        out["tokens"].append(text)
        out["text_offset"].append(pos)
        pos += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        _, lp, top = next(_tokens([e], n))
        out["token_logprobs"].append(_lp(lp))
        d = {decode([t]): _lp(v) for t, v in top}
        d.setdefault(text, _lp(lp))
        out["top_logprobs"].append(d)
    return out


def chat_logprobs(entries, n: int, decode) -> dict:
    """``/v1/chat/completions``' ``logprobs``: ``{"content": [{token, logprob,
    bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    def one(t, v):
        s = decode([t])
        return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}
    content = []
    for tok, lp, top in _tokens(entries, n):
        content.append({**one(tok, lp), "top_logprobs": [one(t, v) for t, v in top]})
    return {"content": content}


def prompt_logprobs_json(entries, decode) -> list:
    """vLLM's ``prompt_logprobs``: None, then ``{token_id: {logprob, rank, decoded_token}}`` per token."""
    return [None if d is None else
            {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in d.items()}
            for d in as_dicts(entries, decode)]
