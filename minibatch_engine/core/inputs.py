"""Checking what users hand the engine: token ids, arrival times, prompt lists.

Every front door (``Engine.add_request``, ``LLM.generate``, ``AsyncLLM``) goes
through these, so a wrong input fails early with a message that names it.
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import numpy as np
import torch


def as_token_id(value, where: str) -> int:
    """One token id: a Python int or an integer numpy/torch scalar (not a bool,
    not a float, not a string)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: token ids must be integers, got the bool {value!r}")
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype.is_floating_point or value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{where}: token ids must be integers, got a tensor of dtype {value.dtype} "
                            f"and shape {tuple(value.shape)}")
        return int(value.item())
    if isinstance(value, numbers.Integral):
        return int(value)
    raise TypeError(f"{where}: token ids must be integers, got {type(value).__name__} {value!r}")


def as_token_ids(prompt, where: str = "prompt") -> list[int]:
    """A prompt of token ids: a list/tuple of ints, or a 1-D integer array/tensor."""
    if isinstance(prompt, str):
        raise TypeError(f"{where}: expected token ids, got text; encode it with a tokenizer first")
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        if prompt.ndim != 1:
            raise TypeError(f"{where}: a token-id array must be 1-D, got shape {tuple(prompt.shape)}")
        prompt = list(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"{where}: expected a list of token ids, got {type(prompt).__name__}")
    if all(type(t) is int for t in prompt):     # plain ints (not bools): nothing to convert
        ids = list(prompt)
    else:
        ids = [as_token_id(t, where) for t in prompt]
    if not ids:
        raise ValueError(f"{where}: a prompt needs at least one token")
    return ids


MAX_ARRIVAL_S = 1e9     # about 32 years: later than any run, early enough to sleep until and add to


def check_arrival_time(t, where: str = "arrival_time") -> float:
    """A finite, non-negative time in the engine's clock (seconds), at most
    ``MAX_ARRIVAL_S`` (a wall-clock engine sleeps until it; a simulated clock
    that large would swallow a step's milliseconds in rounding)."""
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
        raise ValueError(f"{where} must be a finite number of seconds >= 0 in the engine's clock, got {t!r}")
    if t > MAX_ARRIVAL_S:
        raise ValueError(f"{where} must be at most {MAX_ARRIVAL_S:g} seconds (about 32 years), got {t!r}")
    return float(t)


def check_seed(seed, where: str = "seed") -> int:
    """A random seed: an integer in [0, 2**64) (what ``torch.Generator`` takes)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**64:
        raise ValueError(f"{where} must be an integer in [0, 2**64), got {seed!r}")
    return int(seed)


def encode_text(tokenizer, text: str, where: str) -> list[int]:
    """``tokenizer.encode(text)``, with a text that is not valid Unicode (a lone
    surrogate, say) refused by name instead of a bare ``UnicodeEncodeError``."""
    try:
        text.encode("utf-8")          # checked here: tokenizers fail on it each in their own way
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: the text cannot be encoded as UTF-8 ({e.reason}: "
                         f"{e.object[e.start:e.end]!r} at character {e.start})") from None
    return tokenizer.encode(text)


def as_prompt_list(prompts) -> list:
    """The prompts of one ``generate`` call: one text, one list of token ids, or a
    list of either. A bare array or tensor is refused as ambiguous."""
    if prompts is None:
        raise TypeError("prompts is None: pass a string, a list of token ids, or a list of those")
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        raise TypeError("prompts: a bare array/tensor is ambiguous; pass a list of prompts, e.g. "
                        "[ids.tolist()] for one prompt of token ids")
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string, a list of token ids or a list of prompts, "
                        f"got {type(prompts).__name__} (materialise a generator with list(...))")
    if len(prompts) == 0:
        return []
    if isinstance(prompts[0], (numbers.Integral, torch.Tensor)) and not isinstance(prompts[0], bool) \
            and not (isinstance(prompts[0], torch.Tensor) and prompts[0].ndim > 0):
        return [list(prompts)]              # one prompt of token ids
    for i, p in enumerate(prompts):
        if p is None or not isinstance(p, (str, list, tuple, torch.Tensor, np.ndarray)):
            raise TypeError(f"prompts[{i}] must be a string or a list of token ids, got {type(p).__name__}")
    return list(prompts)
