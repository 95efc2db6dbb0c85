"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the served model's
tokenizer over HTTP, in vLLM's shapes, so clients count and cut tokens as
the engine does without loading anything (lm-evaluation-harness's
``local-completions`` asks ``/tokenizer_info`` first and then tokenizes
through ``/tokenize``).

* ``POST /tokenize`` ``{"prompt": str}`` or ``{"messages": [...]}`` (rendered
  with the server's chat template; ``add_generation_prompt`` defaults to
  true) -> ``{"count", "max_model_len", "tokens"}``, plus ``token_strs``
  (each token as its vocabulary spells it) with ``"return_token_strs": true``. The ids are exactly those the server
  computes for the same text prompt. ``add_special_tokens`` is accepted:
  the engine adds no special token to a text prompt either way (the byte
  models' files say ``add_bos_token: false``), so it changes nothing.
* ``POST /detokenize`` ``{"tokens": [int]}`` -> ``{"prompt": str}``.
* ``GET /tokenizer_info`` -> the model folder's ``tokenizer_config.json``
  keys (special tokens, ``model_max_length``, ``chat_template``) and
  ``tokenizer_class``, as vLLM returns them.

They sit outside ``/v1``, so (as in vLLM) the API key does not guard them.
The model's folder is ``root`` in ``/v1/models``: ``AutoTokenizer`` loads
the same tokenizer from there offline.
"""
from __future__ import annotations

import json
from pathlib import Path

from aiohttp import web

from .limits import read_body
from .protocol import APIError, parse_json


def model_folder(llm) -> str | None:
    """The served model's folder (its weights and tokenizer files), or None
    for a model built in memory (``tiny``)."""
    source = getattr(llm.model, "source", None)
    if isinstance(source, (str, Path)) and Path(source).is_dir():
        return str(Path(source).resolve())
    return None


def routes(llm_key, state_key) -> list:
    """The three routes, reading the application's ``llm_key`` and ``state_key``."""

    async def body(request) -> dict:
        st = request.app[state_key]
        data = parse_json(await read_body(request, st["limits"].body_timeout))
        if not isinstance(data, dict):
            raise APIError(f"the body must be a JSON object, got {type(data).__name__}")
        model = data.get("model")
        if model is not None and model != st["model"]:
            raise APIError(f"The model `{model}` does not exist.", "model", 404)
        return data

    def tokenizer(request):
        tok = request.app[llm_key].tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer: the server works on token ids only")
        return tok

    async def tokenize(request):
        data, tok = await body(request), tokenizer(request)
        st, llm = request.app[state_key], request.app[llm_key]
        for key in ("add_special_tokens", "return_token_strs", "add_generation_prompt",
                    "continue_final_message"):
            if key in data and not isinstance(data[key], bool):
                raise APIError(f"'{key}' must be true or false, got {data[key]!r}", key)
        if "messages" in data:
            text = _render(st["chat_template"], data)
        elif isinstance(data.get("prompt"), str):
            text = data["prompt"]
        else:
            raise APIError("send 'prompt' (a string) or 'messages' (a chat)", "prompt")
        ids = tok.encode(text)
        eng = llm.engine
        out = {"count": len(ids), "max_model_len": min(eng.max_model_len, eng.kv_cache.max_tokens_per_request()),
               "tokens": ids}
        if data.get("return_token_strs"):
            out["token_strs"] = [_token_str(tok, i) for i in ids]
        return web.json_response(out)

    async def detokenize(request):
        data, tok = await body(request), tokenizer(request)
        ids = data.get("tokens")
        vocab = request.app[llm_key].engine.model_config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise APIError(f"'tokens' must be a list of token ids, got {ids!r:.80}", "tokens")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise APIError(f"token ids must be in [0, {vocab}), got {bad[:3]}", "tokens")
        return web.json_response({"prompt": tok.decode(ids)})

    async def tokenizer_info(request):
        llm = request.app[llm_key]
        tokenizer(request)
        folder = model_folder(llm)
        cfg = {}
        if folder is not None and (Path(folder) / "tokenizer_config.json").is_file():
            cfg = json.loads((Path(folder) / "tokenizer_config.json").read_text())
        tok = llm.tokenizer
        for key in ("bos", "eos", "pad"):              # a folder without these keys: the ids' texts
            if f"{key}_token" not in cfg and getattr(tok, f"{key}_token_id", None) is not None:
                cfg[f"{key}_token"] = tok.decode([getattr(tok, f"{key}_token_id")]) or None
        cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast" if folder else type(tok).__name__)
        return web.json_response(cfg)

    return [web.post("/tokenize", tokenize), web.post("/detokenize", detokenize),
            web.get("/tokenizer_info", tokenizer_info)]


def _render(template, data: dict) -> str:
    messages = data["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in messages):
        raise APIError("'messages' must be a list of {\"role\": str, \"content\": str}", "messages")
    if data.get("continue_final_message"):      # the templates close every message
        raise APIError("'continue_final_message' is not supported: the chat templates end every "
                       "message; leave it false", "continue_final_message")
    return template(messages, add_generation_prompt=data.get("add_generation_prompt", True))


def _token_str(tok, token_id: int) -> str:
    """One token as its tokenizer spells it (vLLM's ``token_strs``, Hugging
    Face's ``convert_ids_to_tokens``): a special token's text; a byte in GPT-2's
    printable alphabet (a newline is ``Ċ``); an ``HFTokenizer``'s vocabulary entry."""
    from ...model.hf_tokenizer import byte_alphabet
    for text, i in getattr(tok, "special_tokens", {}).items():
        if i == token_id:
            return text
    inner = getattr(tok, "_tok", None)          # HFTokenizer: the tokenizers package's own
    if inner is not None:
        return inner.id_to_token(token_id) or ""
    return byte_alphabet()[token_id] if token_id < 256 else tok.decode([token_id])
