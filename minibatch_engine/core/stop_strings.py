"""Stop strings (``SamplingParams.stop``): where a text ends, and how much of
it may be shown while more tokens may still complete a stop string.

vLLM checks stop strings on the detokenised text, outside its engine core, and
then aborts the request there; the front doors here do the same. The output's
text ends just before the stop string; its tokens end with the token that
completed it.
"""
from __future__ import annotations

from typing import Callable, Sequence


def find_stop(text: str, stops: Sequence[str], after: int = 0) -> int | None:
    """Where ``text`` must end: the start of the earliest stop string in it that
    ends past character ``after`` (None: no stop string occurs)."""
    found = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stops) if i >= 0]
    return min(found) if found else None


def find_stop_end(text: str, stops: Sequence[str], after: int = 0) -> int | None:
    """Where ``text`` must end with ``include_stop_str_in_output``: just after the
    earliest stop string (None: no stop string occurs)."""
    found = [(i, i + len(s)) for i, s in ((text.find(s, max(0, after - len(s) + 1)), s) for s in stops)
             if i >= 0]
    return min(found)[1] if found else None


def min_tokens_text(ids: Sequence[int], decode, params) -> int:
    """Characters of the output a stop string must end past: with ``min_tokens``
    m, vLLM checks stop strings from the m-th token on, so one that ends within
    the first m - 1 tokens' text does not count."""
    m = params.min_tokens
    return len(decode(ids[:m - 1])) if m > 1 else 0


def cut_at(text: str, params, after: int = 0) -> int | None:
    """Where a text ends by ``params.stop`` (None: it does not): before the stop
    string, or after it with ``params.include_stop_str_in_output``."""
    return (find_stop_end if params.include_stop_str_in_output else find_stop)(text, params.stop, after)


def holdback(stops: Sequence[str]) -> int:
    """Characters a stream keeps back at the end of its text: a suffix this long
    may be the start of a stop string still being generated."""
    return max((len(s) for s in stops), default=1) - 1


def tokens_within(ids: Sequence[int], decode: Callable[[Sequence[int]], str], stops: Sequence[str],
                  after: int = 0) -> int:
    """How many of ``ids`` the output keeps: up to and including the token whose
    text completed the first stop string (all of them if none occurs). A text
    that ends in an incomplete character (U+FFFD) is not searched until the
    character completes, as a stream would not show it."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        if (k == len(ids) or not text.endswith("\ufffd")) and find_stop(text, stops, after) is not None:
            return k
    return len(ids)
