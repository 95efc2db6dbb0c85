"""Structured output: a grammar turned into a token mask at every sampling step.

A request may ask that its output be JSON that validates against a schema,
text that matches a regular expression, one of a list of strings, a sentence
of an EBNF grammar, or any JSON object (``SamplingParams.structured_outputs``,
vLLM's :class:`StructuredOutputsParams`). The grammar engine is xgrammar
(Dong et al., MLSys 2025; vLLM V1's default), from PyPI: nothing here parses JSON.

How it works. The grammar is compiled once against the tokenizer's vocabulary
(and cached by its text). Each sequence gets a *matcher*: the grammar's
pushdown automaton in the state the output so far has put it. Before a step
samples a sequence, its matcher fills one row of a *bitmask*: one bit per
vocabulary id, 1 where that token may come next. EOS is one of them only where
the grammar may end. The sampler sets the logits of every 0 bit to ``-inf``, for
all constrained rows of the batch in one operation (:func:`apply_bitmask`);
rows without a grammar are untouched. After sampling, the matcher accepts the
token. A matcher that has accepted EOS is *terminated*, and the request
finishes with reason ``stop``. The mask depends on every token sampled so far,
so it is computed anew at every step, for every constrained sequence.

Who owns what, as in vLLM V1. The scheduler owns the
:class:`StructuredOutputManager` (one matcher per sequence, and the
tokenizer's compiled grammars, a :class:`GrammarCache` shared across engines):
it fills the step's bitmask in ``schedule`` and sends it in the
``SchedulerOutput`` as a numpy array (:class:`GrammarBitmask`, plain data), and
it advances the matchers in ``update_from_output`` with the tokens it appends.
The runner applies the bitmask before sampling. vLLM fills the bitmask while
the GPU runs the step's forward; here the two run one after the other.

Interactions, decided:

* speculative decoding: a constrained request is not speculated (its proposals
  would need checking against the grammar and rolling back); it decodes one
  token per step, like a request that asks for log-probabilities;
* preemption: a matcher advances only when a token is appended, never when
  tokens are computed, so a request recomputed after preemption keeps its
  state and accepts nothing twice; a swapped request keeps it too;
* parallel sampling (``n > 1``): each forked sample gets its own matcher,
  a copy of its parent's taken before either samples;
* chunked prefill and prefix caching: masks apply only to rows that sample;
* log-probabilities: of the raw model distribution, before the mask, so a
  token the grammar forbids can be listed (vLLM masks the logits before its
  sampler computes them, so its log-probabilities are renormalised over the
  allowed tokens).
"""
from __future__ import annotations

import json
import re
import sys
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

KINDS = ("json", "regex", "choice", "grammar", "json_object")
INSTALL = "pip install 'minibatch-engine[structured]'"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must follow (vLLM's ``StructuredOutputsParams``): exactly
    one of ``json`` (a JSON schema, as a dict or its text), ``regex``,
    ``choice`` (a list of strings), ``grammar`` (xgrammar's EBNF, GBNF style:
    ``root ::= ...``) or ``json_object=True`` (any JSON object).

    ``disable_any_whitespace`` (vLLM's name): JSON takes no whitespace beyond
    one space after ``:`` and ``,`` (for ``json`` and ``json_object``). On by
    default here, off in vLLM: given free whitespace, this book's small models
    tend to write whitespace until ``max_tokens``."""

    json: Any = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self):
        set_ = self._given()
        if len(set_) != 1:
            raise ValueError(f"SamplingParams.structured_outputs needs exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(set_) if set_ else 'none'}")
        where = f"SamplingParams.structured_outputs.{set_[0]}"
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where} is not valid JSON ({e})") from None
            if not isinstance(schema, dict):
                raise ValueError(f"{where} must be a JSON schema (an object), got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"SamplingParams.structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            ch = self.choice
            if isinstance(ch, str) or not isinstance(ch, (list, tuple)) or not ch or \
                    not all(isinstance(c, str) and c for c in ch):
                raise ValueError(f"{where} must be a non-empty list of non-empty strings, got {ch!r}")
            object.__setattr__(self, "choice", tuple(ch))
        for name in ("json_object", "disable_any_whitespace"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"SamplingParams.structured_outputs.{name} must be true or false, got {v!r}")

    @property
    def kind(self) -> str:
        """Which of :data:`KINDS` this is."""
        return self._given()[0]

    def _given(self) -> list[str]:
        return [k for k in KINDS if (self.json_object if k == "json_object" else getattr(self, k) is not None)]

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar."""
        kind = self.kind
        if kind in ("json", "json_object"):
            text = json.dumps(self.schema, sort_keys=True)
            return kind, text + ("|compact" if self.disable_any_whitespace else "")
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)

    @property
    def schema(self) -> dict | None:
        """The JSON schema as a dict (``json_object``: any object); None for the other kinds."""
        if self.json is not None:
            return json.loads(self.json) if isinstance(self.json, str) else self.json
        return {"type": "object"} if self.json_object else None

    def __hash__(self) -> int:
        return hash(self.key)

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams | None":
        """``value`` as params: None, params, or a dict of their fields."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(KINDS) - {"disable_any_whitespace"})
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs has unknown keys {unknown}: "
                                 f"it takes {', '.join(KINDS)} and disable_any_whitespace")
            return cls(**value)
        raise ValueError(f"SamplingParams.structured_outputs must be a StructuredOutputsParams or a dict, "
                         f"got {type(value).__name__}")


@dataclass
class GrammarBitmask:
    """One step's masks, plain data for the runner: ``bitmask`` (int32, one row
    per distinct matcher, bit ``t % 32`` of word ``t // 32`` set where token
    ``t`` is allowed) and ``rows`` (sequence id -> its row; a sample forked
    this step shares its parent's)."""
    rows: dict[str, int]
    bitmask: np.ndarray

    def __eq__(self, other) -> bool:
        return isinstance(other, GrammarBitmask) and self.rows == other.rows and \
            np.array_equal(self.bitmask, other.bitmask)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, words]`` int32 -> ``[R, vocab_size]`` bool (True: allowed). Each
    word is read as its four bytes, lowest first (the little-endian layout of
    every CPU and GPU this runs on), and each byte as eight bits: one byte of
    work per token, not four."""
    if sys.byteorder != "little":        # pragma: no cover - no big-endian machine to test on
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        return ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab_size]
    octets = bitmask.contiguous().view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (octets[:, :, None] >> shifts) & 1
    return bits.view(torch.bool).reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: Sequence[int],
                  masks: Sequence[int]) -> torch.Tensor:
    """``logits`` ``[S, vocab]`` with ``-inf`` where the grammar forbids a token,
    in rows ``rows`` (row ``rows[i]`` takes ``bitmask[masks[i]]``); a new
    tensor, the other rows unchanged. One unpack and one masked fill for the
    whole batch, whatever the vocabulary."""
    if not len(rows):
        return logits.clone()
    dev = logits.device
    allowed = unpack_bitmask(torch.from_numpy(bitmask[list(masks)]).to(dev), logits.shape[1])
    keep = torch.ones(logits.shape, dtype=torch.bool, device=dev)
    keep[torch.tensor(list(rows), device=dev)] = allowed
    return logits.masked_fill(~keep, float("-inf"))


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError(f"structured output needs the optional 'xgrammar' package: {INSTALL}") from None
    return xgrammar


def tokenizer_info(tokenizer, vocab_size: int, eos_token_id: int):
    """xgrammar's view of a tokenizer: the bytes of every token id and the stop
    token. A byte-level tokenizer (``token_bytes``) is given raw (ids 0..255 are
    bytes, special ids empty); a Hugging Face one (``backend``, a
    ``tokenizers.Tokenizer``, or a ``transformers`` tokenizer) through
    xgrammar's reader, which knows byte-level and byte-fallback vocabularies,
    with its special tokens emptied too.
    ``vocab_size``: the model's logits width (ids past the tokenizer's never
    allowed)."""
    xgr = _xgrammar()
    if hasattr(tokenizer, "token_bytes"):
        vocab = list(tokenizer.token_bytes())
        vocab += [b""] * (vocab_size - len(vocab))
        return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=[eos_token_id])
    hf = tokenizer
    if hasattr(tokenizer, "backend"):
        from transformers import PreTrainedTokenizerFast
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    detected = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos_token_id])
    # xgrammar reads a special token ("<|bos|>") as its text, so a grammar could
    # let one into a JSON string, and decoding (which skips special tokens) would
    # drop it: special tokens get no bytes here, so they are never allowed.
    special = {i for i, t in hf.added_tokens_decoder.items() if t.special}
    vocab = [""] * vocab_size
    for token, i in hf.get_vocab().items():
        if i < vocab_size and i not in special:
            vocab[i] = token
    return xgr.TokenizerInfo(vocab, vocab_type=detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=[eos_token_id], add_prefix_space=detected.add_prefix_space)


def _message(e: Exception) -> str:
    """xgrammar's error without its C++ source location."""
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)


class GrammarCache:
    """xgrammar's compiler for one tokenizer and the grammars it compiled, by
    key (:attr:`StructuredOutputsParams.key`), least recently used dropped past
    ``max_cached``. One per (tokenizer, vocabulary size, EOS), shared by every
    engine that uses that tokenizer (:func:`grammar_cache`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int, max_cached: int = 256):
        self.info = tokenizer_info(tokenizer, vocab_size, eos_token_id)
        self.compiler = _xgrammar().GrammarCompiler(self.info, max_threads=1)
        self.grammars: OrderedDict[tuple, object] = OrderedDict()
        self.max_cached = max_cached
        self.hits = self.misses = 0
        self._lock = threading.Lock()        # a server compiles on its event loop, an engine in its thread

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (from the cache when seen before);
        a ``ValueError`` naming the field when xgrammar refuses it."""
        key = params.key
        with self._lock:
            if key in self.grammars:
                self.hits += 1
                self.grammars.move_to_end(key)
                return self.grammars[key]
        kind, c = params.kind, self.compiler
        try:
            if kind in ("json", "json_object"):
                grammar = c.compile_json_schema(params.schema, any_whitespace=not params.disable_any_whitespace)
            elif kind == "regex":
                grammar = c.compile_regex(params.regex)
            elif kind == "choice":     # each choice a quoted literal (JSON's escapes are EBNF's)
                grammar = c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in params.choice))
            else:
                grammar = c.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind}: {_message(e)}") from None
        with self._lock:
            self.misses += 1
            self.grammars[key] = grammar
            if len(self.grammars) > self.max_cached:
                self.grammars.popitem(last=False)
        return grammar


_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def grammar_cache(tokenizer, vocab_size: int, eos_token_id: int) -> GrammarCache:
    """The :class:`GrammarCache` of ``tokenizer`` (built on first use, kept while
    the tokenizer lives): building xgrammar's view of a large vocabulary takes
    a while, and each ``LLM.generate`` call builds a new engine."""
    per = _CACHES.setdefault(tokenizer, {})
    key = (vocab_size, eos_token_id)
    if key not in per:
        per[key] = GrammarCache(tokenizer, vocab_size, eos_token_id)
    return per[key]


class StructuredOutputManager:
    """One engine's structured output: the grammars of its tokenizer (a shared
    :class:`GrammarCache`) and one matcher per sequence.

    ``tokenizer``: the engine's (see :func:`tokenizer_info`); ``vocab_size``:
    the model's; ``eos_token_id``: the token that ends a constrained output."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        self.grammars = grammar_cache(tokenizer, vocab_size, eos_token_id)
        self.batch = _xgrammar().BatchGrammarMatcher(max_threads=1)
        self.words = (vocab_size + 31) // 32
        self.matchers: dict[str, object] = {}

    def compile(self, params: StructuredOutputsParams):
        """See :meth:`GrammarCache.compile`."""
        return self.grammars.compile(params)

    def add_request(self, seq_id: str, params: StructuredOutputsParams) -> None:
        """A matcher for ``seq_id`` at the grammar's start."""
        self.matchers[seq_id] = _xgrammar().GrammarMatcher(self.compile(params))

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` starts from a copy of its parent's matcher."""
        self.matchers[child_id] = self.matchers[parent_id].fork()

    def accept(self, seq_id: str, token: int) -> bool:
        """Advance ``seq_id``'s matcher by a sampled token; False if the grammar forbids it."""
        return bool(self.matchers[seq_id].accept_token(int(token)))

    def is_terminated(self, seq_id: str) -> bool:
        """The matcher accepted a stop token: the output is complete."""
        return bool(self.matchers[seq_id].is_terminated())

    def free(self, seq_id: str) -> None:
        self.matchers.pop(seq_id, None)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.matchers

    def grammar_bitmask(self, rows: Sequence[tuple[str, str]]) -> GrammarBitmask:
        """The masks of one step: ``rows`` are (sequence id, id of the matcher
        whose state it samples from); each distinct matcher fills one row, in one
        batched call."""
        order: dict[str, int] = {}
        for _, m in rows:
            order.setdefault(m, len(order))
        bitmask = np.zeros((len(order), self.words), dtype=np.int32)
        if order:
            self.batch.batch_fill_next_token_bitmask([self.matchers[m] for m in order], bitmask)
        return GrammarBitmask({s: order[m] for s, m in rows}, bitmask)
