"""Checking configuration values, written once for every owner's config
(:class:`~minibatch_engine.scheduler.config.SchedulerConfig`,
:class:`~minibatch_engine.kv.config.CacheConfig`, ...): each message names the
field and what it accepts."""
from __future__ import annotations

import math


def check_choice(name: str, value, options) -> None:
    if value not in options:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, options))}")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{' or None' if optional else ''}, got {value!r}")


def check_number(name: str, value, low: float, high: float, low_open: bool = False,
                 high_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or value > high or (low_open and value == low) or (high_open and value == high):
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
