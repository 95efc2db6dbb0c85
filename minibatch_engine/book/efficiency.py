"""Batch efficiency eta: useful token positions over computed token positions.

Two closed forms for one static batch of B requests with prompt lengths p_i and
output lengths g_i:

* the textbook form idealises each lane as its prompt followed by its output,
  the batch lasting as long as its longest lane:
  eta = sum_i (p_i + g_i) / (B * max_i (p_i + g_i));
* the padded layout that ``generate`` (and the engine's static scheduler)
  really computes pads every prompt to the longest prompt P and decodes every
  lane to the longest output G; the last sampled token is never fed back, so a
  lane computes P + G - 1 token rows of which p_i + g_i - 1 are its own:
  eta = sum_i (p_i + g_i - 1) / (B * (P + G - 1)).

Since max_i(p_i + g_i) <= P + G, the textbook figure is the optimistic one.
The engine measures eta from its trace; these formulas are what it must equal.
"""
from __future__ import annotations

from typing import Sequence


def _check(batch: Sequence[tuple[int, int]]) -> None:
    if not batch:
        raise ValueError("a batch needs at least one (prompt_len, output_len) pair")
    if any(p < 1 or g < 1 for p, g in batch):
        raise ValueError("prompt and output lengths must be >= 1")


def eta_textbook(batch: Sequence[tuple[int, int]]) -> float:
    """sum(p + g) / (B * max(p + g)) for one batch of (prompt_len, output_len)."""
    _check(batch)
    return sum(p + g for p, g in batch) / (len(batch) * max(p + g for p, g in batch))


def padded_token_counts(batch: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(useful, computed) token rows of the padded layout of one batch."""
    _check(batch)
    P, G = max(p for p, _ in batch), max(g for _, g in batch)
    return sum(p + g - 1 for p, g in batch), len(batch) * (P + G - 1)


def eta_padded(batch: Sequence[tuple[int, int]]) -> float:
    """sum(p + g - 1) / (B * (P + G - 1)): the layout padded ``generate`` computes."""
    useful, computed = padded_token_counts(batch)
    return useful / computed


def split_batches(lengths: Sequence[tuple[int, int]], batch_size: int) -> list[list[tuple[int, int]]]:
    """Consecutive batches of ``batch_size`` in arrival order (the last may be short)."""
    return [list(lengths[i:i + batch_size]) for i in range(0, len(lengths), batch_size)]


def eta_run(lengths: Sequence[tuple[int, int]], batch_size: int, form: str = "padded") -> float:
    """eta of a whole run of consecutive batches: total useful over total computed."""
    batches = split_batches(lengths, batch_size)
    if form == "padded":
        counts = [padded_token_counts(b) for b in batches]
    elif form == "textbook":
        counts = [(sum(p + g for p, g in b), len(b) * max(p + g for p, g in b)) for b in batches]
    else:
        raise ValueError(f"form must be 'padded' or 'textbook', got {form!r}")
    return sum(u for u, _ in counts) / sum(c for _, c in counts)
