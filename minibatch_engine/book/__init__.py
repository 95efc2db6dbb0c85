"""Helpers for the book's chapters, kept apart from the engine core: figures
(:mod:`.plotting`), tables (:mod:`.report`), the batch-efficiency formulas of
chapter 2 (:mod:`.efficiency`) and :func:`glue`."""
from .glue import glue

__all__ = ["glue"]
