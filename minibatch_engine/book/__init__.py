"""Helpers for the book's chapters, kept apart from the engine core: figures
(:mod:`.plotting`), tables (:mod:`.report`), the batch-efficiency formulas of
chapter 2 (:mod:`.efficiency`), the policy runs of chapter 7
(:mod:`.policy_runs`), the load sweeps' tables of chapter 8 (:mod:`.load_report`)
and :func:`glue`."""
from .glue import glue

__all__ = ["glue"]
