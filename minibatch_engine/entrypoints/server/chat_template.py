"""Turning a chat (a list of ``{"role", "content"}`` messages) into one prompt.

A chat model learned one layout of roles and turns, stored as a Jinja
template in its checkpoint (``tokenizer_config.json``'s ``chat_template``);
vLLM renders that template, or one given with ``--chat-template``. The
byte-level models of this book (``tiny``, ``tiny-py``) were trained on plain
text and have none, so they get this documented one, one header line per turn
and the reply opened at the end::

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

(each message is ``<|role|>\\n`` + its content + ``\\n``; then
``<|assistant|>\\n``, where the model's reply begins). Those models never saw
the layout, so their replies are only as good as their training; the layout
matters for the API's shape, not for quality.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ...model.hf_tokenizer import BYTE_LEVEL_TEMPLATE



def byte_level_chat(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The byte-level models' template (the module doc), in plain Python."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def load_chat_template(source=None, path: str | None = None) -> Callable[[list[dict]], str]:
    """The renderer for a model: the Jinja file ``path`` if given (vLLM's
    ``--chat-template``), else the checkpoint's own ``chat_template`` if
    ``source`` is a directory that has one, else :func:`byte_level_chat`."""
    text = None
    if path is not None:
        text = Path(path).read_text()
    elif isinstance(source, (str, Path)) and (Path(source) / "tokenizer_config.json").is_file():
        text = json.loads((Path(source) / "tokenizer_config.json").read_text()).get("chat_template")
    if not isinstance(text, str):
        return byte_level_chat
    try:
        import jinja2
    except ImportError:
        raise ValueError("this chat template is Jinja: pip install jinja2") from None
    try:
        template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(text)
    except jinja2.TemplateSyntaxError as e:
        where = f"--chat-template {path}" if path is not None else f"the chat template of {source}"
        raise ValueError(f"{where}: Jinja syntax error on line {e.lineno}: {e.message}") from None
    return lambda messages, add_generation_prompt=True: template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="", eos_token="")
