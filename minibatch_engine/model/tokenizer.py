"""Tokenizers: text <-> token ids.

Two implementations with one interface (``encode``, ``decode``, ``eos_token_id``,
``bos_token_id``, ``pad_token_id``, ``vocab_size``):

* :class:`ByteTokenizer` for the built-in ``tiny`` model: every UTF-8 byte is its
  own token (ids 0..255), plus three special ids (BOS, EOS, PAD). No files needed.
* :class:`HFTokenizer` for a Hugging Face checkpoint: wraps the ``tokenizer.json``
  found next to the weights, using the optional ``tokenizers`` package.

:func:`load_tokenizer` picks one for a model. A checkpoint folder says it uses the
byte tokenizer (as the trained ``tiny-py`` models do) with a ``tokenizer_config.json``
holding ``{"minibatch_engine_tokenizer": "byte"}`` (Hugging Face ignores the key);
optional ``bos_token_id``/``eos_token_id``/``pad_token_id`` there are checked
against the byte tokenizer's ids. Otherwise the folder needs a ``tokenizer.json``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

from .config import BOS_ID, BYTE_VOCAB, EOS_ID, PAD_ID, PRESETS, TINY
from .loader import CheckpointError, _first_id

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer"]


class ByteTokenizer:
    """Byte-level tokenizer of the built-in ``tiny`` model.

    Ids 0..255 are the bytes of the UTF-8 encoding; 256, 257, 258 are BOS, EOS and
    PAD. ``vocab_size`` matches the tiny model's embedding table (260: one id is
    unused). Any text round-trips exactly; decoding an arbitrary id sequence may
    cut a multi-byte character, which then shows as U+FFFD.

    ``special_tokens`` (text -> id, e.g. ``{"<|eos|>": 257}``): texts that
    encode as that one id rather than as their bytes, as a Hugging Face
    tokenizer reads its special tokens in a prompt. A checkpoint's
    ``tokenizer_config.json`` declares them (``"eos_token": "<|eos|>"``), so
    the engine, the server's ``/tokenize`` and ``AutoTokenizer`` give the same
    ids; the built-in ``tiny`` declares none.
    """

    def __init__(self, special_tokens: dict[str, int] | None = None):
        self.special_tokens = dict(special_tokens or {})
        self._split = (re.compile("(" + "|".join(map(re.escape, sorted(self.special_tokens, key=len,
                                                                        reverse=True))) + ")")
                       if self.special_tokens else None)

    @property
    def bos_token_id(self) -> int:
        return BOS_ID

    @property
    def eos_token_id(self) -> int:
        return EOS_ID

    @property
    def pad_token_id(self) -> int:
        return PAD_ID

    @property
    def vocab_size(self) -> int:
        return TINY.vocab_size

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for: one byte for ids 0..255, none for the
        special ids (what a grammar engine needs to know of the vocabulary)."""
        return [bytes([b]) for b in range(BYTE_VOCAB)] + [b""] * (self.vocab_size - BYTE_VOCAB)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes, optionally preceded by BOS."""
        if self._split is None:
            ids = list(text.encode("utf-8"))
        else:           # odd pieces are special-token texts (the pattern's one group)
            ids = []
            for k, piece in enumerate(self._split.split(text)):
                ids.extend([self.special_tokens[piece]] if k % 2 else piece.encode("utf-8"))
        return [BOS_ID] + ids if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special (non-byte) ids are skipped, invalid UTF-8 is replaced."""
        data = bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i < BYTE_VOCAB:
                data.append(i)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer({self.special_tokens})" if self.special_tokens else "ByteTokenizer()"


#: key of ``tokenizer_config.json`` naming one of our own tokenizers, and its values
TOKENIZER_KEY = "minibatch_engine_tokenizer"
BYTE_TOKENIZER = "byte"


def _read_json(file: Path) -> dict:
    """A side file (``config.json``, ``generation_config.json``) that only supplies
    fallback ids: missing or unreadable means "no information"."""
    try:
        data = json.loads(file.read_text()) if file.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_json_object(file: Path) -> dict:
    """A tokenizer file that must be a JSON object; anything else is a clear error."""
    return json.loads(_json_object_text(file))


def _json_object_text(file: Path) -> str:
    """The text of ``file``, checked to be one JSON object (else a :class:`CheckpointError`
    naming the file)."""
    try:
        text = file.read_text(encoding="utf-8")
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file.name} in {str(file.parent)!r} is not valid JSON ({e}); "
                              "replace it with the checkpoint's original file") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file.name} in {str(file.parent)!r} should hold a JSON object, "
                              f"got {type(data).__name__}; replace it with the checkpoint's "
                              "original file")
    return text


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (via the ``tokenizers`` package).

    ``path`` is a checkpoint directory holding ``tokenizer.json``. The special ids
    come from the checkpoint's ``config.json`` (then ``generation_config.json``,
    then the token strings named in ``tokenizer_config.json``); pass them
    explicitly to override.

    ``encode`` never lets the tokenizer's post-processor add special tokens: BOS is
    added only when asked with ``add_bos=True``, so prompts stay explicit.
    """

    def __init__(self, path: str | Path, eos_token_id: int | None = None,
                 bos_token_id: int | None = None, pad_token_id: int | None = None):
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise CheckpointError(f"no tokenizer.json in {str(path)!r}")
        self.path = path
        text = _json_object_text(file)      # a broken file is named before anything else
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("HFTokenizer needs the optional 'tokenizers' package: "
                              "pip install 'minibatch-engine[hf]'") from None
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:      # the tokenizers package raises a bare Exception
            raise CheckpointError(f"tokenizer.json in {str(path)!r} is not a tokenizer the "
                                  f"'tokenizers' package can read: {e}") from None

        cfg = _read_json(path / "config.json")
        gen = _read_json(path / "generation_config.json")
        tok_file = path / "tokenizer_config.json"
        tok_cfg = _read_json_object(tok_file) if tok_file.is_file() else {}

        def pick(explicit, key):
            for value in (explicit, cfg.get(key), gen.get(key)):
                value = _first_id(value)
                if value is not None:
                    return value
            token = tok_cfg.get(key.replace("_id", ""))     # e.g. "eos_token": "</s>"
            if isinstance(token, dict):                      # older files: {"content": ...}
                token = token.get("content")
            return self._tok.token_to_id(token) if isinstance(token, str) else None

        self._eos = pick(eos_token_id, "eos_token_id")
        self._bos = pick(bos_token_id, "bos_token_id")
        self._pad = pick(pad_token_id, "pad_token_id")

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def pad_token_id(self) -> int | None:
        return self._pad

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` underneath (a grammar engine reads its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included. (A model's
        embedding table may be larger: vocabularies are often padded.)"""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally preceded by BOS (when the checkpoint has one)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self._bos is not None:
            ids = [self._bos] + ids
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, skipping special tokens (BOS, EOS, PAD and any token the
        tokenizer marks special)."""
        specials = {self._bos, self._eos, self._pad}
        return self._tok.decode([int(i) for i in ids if int(i) not in specials],
                                skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _byte_tokenizer_for(path: Path, tok_cfg: dict) -> ByteTokenizer:
    """The byte tokenizer a checkpoint asks for, after checking its special ids."""
    file = path / "tokenizer_config.json"
    kind = tok_cfg[TOKENIZER_KEY]
    if kind != BYTE_TOKENIZER:
        raise CheckpointError(f"{file.name} in {str(path)!r} names tokenizer "
                              f"{TOKENIZER_KEY}={kind!r}; the only one built in is "
                              f"{BYTE_TOKENIZER!r}")
    specials = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        text = tok_cfg.get(key)
        text = text.get("content") if isinstance(text, dict) else text
        if isinstance(text, str) and text:
            specials[text] = getattr(ByteTokenizer(), key + "_id")
    tok = ByteTokenizer(specials)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in tok_cfg and tok_cfg[key] != getattr(tok, key):
            raise CheckpointError(f"{file.name} in {str(path)!r} says {key}={tok_cfg[key]!r}, but "
                                  f"the byte tokenizer's {key} is {getattr(tok, key)}")
    return tok


def load_tokenizer(path_or_preset: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer for a model: :class:`ByteTokenizer` for the ``"tiny"`` preset
    and for a checkpoint whose ``tokenizer_config.json`` says
    ``"minibatch_engine_tokenizer": "byte"`` (the trained ``tiny-py`` models);
    :class:`HFTokenizer` for a checkpoint directory holding ``tokenizer.json``."""
    if isinstance(path_or_preset, str) and path_or_preset.lower() == "tiny":
        return ByteTokenizer()
    path = Path(path_or_preset)
    tok_cfg_file = path / "tokenizer_config.json"
    if tok_cfg_file.is_file():
        tok_cfg = _read_json_object(tok_cfg_file)
        if TOKENIZER_KEY in tok_cfg:
            return _byte_tokenizer_for(path, tok_cfg)
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path)
    if isinstance(path_or_preset, str) and path_or_preset.lower() in PRESETS and not path.exists():
        raise CheckpointError(f"preset {path_or_preset!r} only describes shapes and has no "
                              "tokenizer; only 'tiny' has a built-in one")
    if not path.is_dir():
        raise CheckpointError(f"no tokenizer for {str(path_or_preset)!r}: not 'tiny' and not a "
                              "checkpoint directory")
    raise CheckpointError(f"no tokenizer.json in checkpoint directory {str(path)!r}")
