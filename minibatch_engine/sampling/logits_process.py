"""Logits processors: what a request's sampling parameters do to its logits
before a token is picked, for the whole batch at once.

vLLM V1's sampler applies them in this order, and so does this one: bad words,
``min_tokens``, ``logit_bias``, then the penalties (repetition, frequency,
presence); greedy rows then take the argmax, sampled rows apply temperature,
``min_p``, top-k and top-p (:mod:`minibatch_engine.sampling`). Each is a
tensor operation over the rows that use it; Python loops run over rows and
over the few token ids a request names (its stop tokens, biased tokens, bad
words), never over the vocabulary. The penalties count each row's output
tokens with one ``scatter_add_`` into a ``[rows, vocab]`` tensor.

- ``repetition_penalty`` r (CTRL, Keskar et al. 2019; vLLM's form): a token seen
  in the prompt or the output has its logit divided by r if positive,
  multiplied by r if not.
- ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's): the logit of a
  token that occurs c times in the output loses ``f * c + p * (c > 0)``.
- ``min_tokens`` m: until the output has m tokens, EOS (unless ``ignore_eos``)
  and ``stop_token_ids`` get ``-inf``.
- ``logit_bias``: added to the named tokens' logits.
- ``bad_words``: a word's last token gets ``-inf`` where the output ends with
  the word's other tokens (a one-token word always).
- ``min_p`` (Nguyen et al. 2024): after temperature T, tokens with probability
  below ``min_p`` times the top token's go. Applied here before temperature, as
  the same cut on logits: ``logit < max_logit + T * ln(min_p)``.

A greedy request with penalties takes the argmax of the penalised logits, as
in vLLM.
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch


def _number(p, name: str, low: float, high: float, fix: str, low_open: bool = False) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or \
            not ((low < v) if low_open else (low <= v)) or not v <= high:
        within = f"{'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"SamplingParams.{name} must be a number in {within}, got {v!r} ({fix})")


def _count(p, name: str, low: int, fix: str, allow_none: bool = False, also: tuple = ()) -> None:
    v = getattr(p, name)
    if allow_none and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or (v < low and v not in also):
        raise ValueError(f"SamplingParams.{name} must be an integer >= {low}"
                         f"{' or None' if allow_none else ''}, got {v!r} ({fix})")


def check_params(p) -> None:
    """Check (and normalise) the fields this module and the log-probabilities
    read; called by ``SamplingParams.__post_init__``. Messages name the field,
    the value and the fix."""
    _number(p, "presence_penalty", -2.0, 2.0, "0 switches it off")
    _number(p, "frequency_penalty", -2.0, 2.0, "0 switches it off")
    _number(p, "repetition_penalty", 0.0, math.inf, "1 switches it off; > 1 discourages repeats",
            low_open=True)
    _number(p, "min_p", 0.0, 1.0, "0 switches it off")
    _count(p, "min_tokens", 0, "0 switches it off")
    if p.min_tokens > p.max_tokens:
        raise ValueError(f"SamplingParams.min_tokens ({p.min_tokens}) must be at most max_tokens "
                         f"({p.max_tokens}): lower it or raise max_tokens")
    _count(p, "logprobs", 0, "None: no log-probabilities; 0: the sampled token's only", allow_none=True)
    _count(p, "prompt_logprobs", 0, "None: none; 0: each prompt token's only", allow_none=True)
    _count(p, "truncate_prompt_tokens", 1, "the prompt's last k tokens are kept; -1: as many as fit",
           allow_none=True, also=(-1,))
    if not isinstance(p.include_stop_str_in_output, bool):
        raise ValueError(f"SamplingParams.include_stop_str_in_output must be True or False, "
                         f"got {p.include_stop_str_in_output!r}")
    bias = p.logit_bias
    if bias is not None:
        pairs = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = [(k, v) for k, v in pairs]
        except (TypeError, ValueError):
            raise ValueError(f"SamplingParams.logit_bias must map token ids to biases, got {bias!r} "
                             "(write {5: -100.0})") from None
        for k, v in pairs:
            if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0 or \
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
                raise ValueError(f"SamplingParams.logit_bias must map token ids (>= 0) to biases in "
                                 f"[-100, 100], got {k!r}: {v!r}")
        object.__setattr__(p, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in pairs)) or None)
    words = (p.bad_words,) if isinstance(p.bad_words, str) else p.bad_words
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
        raise ValueError(f"SamplingParams.bad_words must be a list of non-empty strings, got {p.bad_words!r}")
    object.__setattr__(p, "bad_words", tuple(words))
    seqs = p.bad_words_token_ids
    if not isinstance(seqs, (list, tuple)) or not all(
            isinstance(w, (list, tuple)) and w and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                        and t >= 0 for t in w) for w in seqs):
        raise ValueError(f"SamplingParams.bad_words_token_ids must be a list of non-empty token-id lists, "
                         f"got {seqs!r}")
    object.__setattr__(p, "bad_words_token_ids", tuple(tuple(int(t) for t in w) for w in seqs))


def needs_history(p) -> bool:
    """The request's processors read its earlier tokens (the runner keeps them)."""
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                or p.min_tokens or p.bad_words_token_ids)


def needs_processing(p) -> bool:
    """Anything here changes this request's logits."""
    return needs_history(p) or bool(p.logit_bias) or p.min_p > 0.0


def bad_words_token_ids(words: Sequence[str], encode) -> tuple[tuple[int, ...], ...]:
    """Token sequences for ``bad_words``: each word as written (leading spaces
    dropped) and with one leading space, the second kept only where it is a
    different token sequence of the same length (a word starting mid-text), as
    vLLM tokenises them. ``encode``: text -> token ids, no special tokens."""
    out: list[tuple[int, ...]] = []
    for w in words:
        bare = tuple(encode(w.lstrip()))
        out.append(bare)
        spaced = tuple(encode(" " + w.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(w for w in out if w)


def apply_logits_processors(logits: torch.Tensor, params: Sequence, histories: Sequence,
                            num_prompt_tokens: Sequence[int], eos_token_id: int | None) -> torch.Tensor:
    """The processed logits (float32, a new tensor) of ``logits`` ``[S, vocab]``.

    ``histories[i]``: row i's tokens so far (prompt then outputs; None where the
    row needs none, see :func:`needs_history`); ``num_prompt_tokens[i]``: where
    its outputs start. Rows that ask for nothing come back unchanged."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()
    S, vocab = x.shape
    dev = x.device
    outputs = [None if h is None else h[n:] for h, n in zip(histories, num_prompt_tokens)]
    # bad words and min_tokens: -inf at (row, token) pairs; logit_bias: added at pairs
    ban_r, ban_t, bias_r, bias_t, bias_v = [], [], [], [], []
    for i, p in enumerate(params):
        out = outputs[i]
        for w in p.bad_words_token_ids:
            if len(w) == 1 or (len(out) >= len(w) - 1 and tuple(out[len(out) - len(w) + 1:]) == w[:-1]):
                ban_r.append(i)
                ban_t.append(w[-1])
        if p.min_tokens and len(out) < p.min_tokens:
            stops = {t for t in p.stop_token_ids if t < vocab}      # (an id past it can never be drawn)
            if eos_token_id is not None and not p.ignore_eos and eos_token_id < vocab:
                stops.add(eos_token_id)
            ban_r += [i] * len(stops)
            ban_t += sorted(stops)
        for t, b in p.logit_bias or ():
            bias_r.append(i)
            bias_t.append(t)
            bias_v.append(b)
    if ban_t:
        x[torch.tensor(ban_r, device=dev), torch.tensor(ban_t, device=dev)] = float("-inf")
    if bias_t:
        x.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                     torch.tensor(bias_v, device=dev, dtype=x.dtype), accumulate=True)
    _penalise(x, params, histories, outputs)
    rows = [i for i, p in enumerate(params) if p.min_p > 0.0 and not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=dev)
        cut = torch.tensor([p.temperature * math.log(p.min_p) for p in (params[i] for i in rows)],
                           device=dev, dtype=x.dtype)
        sub = x[idx]
        keep = sub >= sub.max(dim=-1, keepdim=True).values + cut[:, None]
        x[idx] = sub.masked_fill_(~keep, float("-inf"))
    return x


def _penalise(x: torch.Tensor, params, histories, outputs) -> None:
    """Repetition, then frequency and presence penalties, in place, on the rows that set them."""
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty]
    if not rows:
        return
    dev, vocab = x.device, x.shape[1]

    def padded(seqs):            # ragged token lists -> [R, L], padded with the spare column `vocab`
        width = max(1, max(map(len, seqs)))
        return torch.tensor([list(s) + [vocab] * (width - len(s)) for s in seqs], device=dev)

    out_ids = padded([outputs[i] for i in rows])
    counts = torch.zeros(len(rows), vocab + 1, device=dev, dtype=x.dtype)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=x.dtype))
    counts = counts[:, :vocab]
    idx = torch.tensor(rows, device=dev)
    sub = x[idx]
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=dev, dtype=x.dtype)[:, None]
    if (rep != 1.0).any():
        seen = torch.zeros(len(rows), vocab + 1, device=dev, dtype=torch.bool)
        seen.scatter_(1, padded([histories[i] for i in rows]), True)
        factor = torch.where(seen[:, :vocab], rep, torch.ones_like(rep))
        sub = torch.where(sub > 0, sub / factor, sub * factor)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=dev, dtype=x.dtype)[:, None]
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=dev, dtype=x.dtype)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(x.dtype)
    x[idx] = sub


def with_bad_words(params, tokenizer, where: str):
    """``params`` with ``bad_words`` tokenised (what a front door does before the
    engine sees the request); unchanged when there are none."""
    if not params.bad_words or params.bad_words_token_ids:
        return params
    if tokenizer is None:
        raise ValueError(f"{where}: bad_words need a tokenizer and this model has none "
                         "(set bad_words_token_ids instead)")
    import dataclasses
    return dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words,
                                                                               tokenizer.encode))
