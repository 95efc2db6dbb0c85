"""The byte tokenizer as Hugging Face files, so that other tools can load it.

Load generators and evaluation harnesses (guidellm, lm-evaluation-harness)
load a served model's tokenizer with ``transformers``' ``AutoTokenizer`` from
the model's folder. The trained byte-level models (``tiny-py`` and its draft)
use :class:`~minibatch_engine.model.tokenizer.ByteTokenizer`: each UTF-8 byte
is one token whose id is the byte's value, and 256, 257, 258 are BOS, EOS and
PAD. :func:`write_hf_tokenizer_files` writes the same tokenizer in Hugging
Face's format:

* ``tokenizer.json``: a byte-level BPE with no merges. GPT-2's byte-level
  pre-tokenizer spells each byte as one printable character, and the
  vocabulary gives that character the byte's value as its id. So every byte
  stays one token, and ``AutoTokenizer`` gives exactly the engine's ids.
* ``tokenizer_config.json``: the special tokens (``<|bos|>``, ``<|eos|>``,
  ``<|pad|>``) and the chat template the server uses for these models
  (:data:`BYTE_LEVEL_TEMPLATE`), beside the engine's own key
  (``"minibatch_engine_tokenizer": "byte"``).

Both read the literal text of a special token (``"<|eos|>"``) in a prompt
as that one token: the engine's byte tokenizer takes the special tokens this
file declares (:func:`~minibatch_engine.model.tokenizer.load_tokenizer`).
"""
from __future__ import annotations

import json
from pathlib import Path

from .config import BOS_ID, EOS_ID, PAD_ID

#: The byte-level models' chat template (Jinja, as in a checkpoint's
#: ``tokenizer_config.json``): ``<|role|>\n`` + content + ``\n`` per message,
#: then ``<|assistant|>\n`` where the reply begins.
BYTE_LEVEL_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
                       "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

SPECIAL_TOKENS = {"bos_token": ("<|bos|>", BOS_ID), "eos_token": ("<|eos|>", EOS_ID),
                  "pad_token": ("<|pad|>", PAD_ID)}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: bytes that print as themselves
    (``!`` to ``~``, ``¡`` to ``¬``, ``®`` to ``ÿ``) keep their character; the
    others take the characters from U+0100 on, in byte order."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    out, shifted = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


def tokenizer_json() -> str:
    """``tokenizer.json`` of the byte tokenizer (needs the ``tokenizers`` package)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_alphabet().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    for text, token_id in sorted(SPECIAL_TOKENS.values(), key=lambda t: t[1]):
        tok.add_special_tokens([AddedToken(text, special=True)])
        if tok.token_to_id(text) != token_id:
            raise AssertionError(f"{text} got id {tok.token_to_id(text)}, expected {token_id}")
    return json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n"


def tokenizer_config(max_length: int) -> dict:
    """The Hugging Face keys of ``tokenizer_config.json`` for the byte tokenizer."""
    cfg = {"minibatch_engine_tokenizer": "byte",
           "tokenizer_class": "PreTrainedTokenizerFast",
           "model_max_length": max_length,
           "add_bos_token": False, "add_eos_token": False,
           "clean_up_tokenization_spaces": False,
           "chat_template": BYTE_LEVEL_TEMPLATE}
    for key, (text, token_id) in SPECIAL_TOKENS.items():
        cfg[key] = text
        cfg[key + "_id"] = token_id
    return cfg


def write_hf_tokenizer_files(folder: str | Path, max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (a
    byte-level checkpoint's folder), so ``AutoTokenizer.from_pretrained(folder)``
    gives the engine's ids."""
    folder = Path(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(max_length), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
