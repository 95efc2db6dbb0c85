"""Explorables: the chapters' figures a reader can drag, on the static site
(no kernel, no network) and in JupyterLab. Each is one HTML output built from
a chapter's own runs (:mod:`.base`); the browser only does arithmetic on that
data, and ``tools/check_explorables.py`` checks every control and every
number it computes against Python's.

* :func:`eta_explorer` (chapter 2): σ and B -> η, the padded layout drawn.
* :func:`step_scrubber` of :func:`trace_panel` s (chapters 3, 5, 6): a step
  slider over engine traces.
* :func:`block_explorer` of :func:`block_run` s (chapter 4): block tables,
  sharing and copy-on-write, paged against reserved memory.
* :func:`policy_latency` (chapter 7) and :func:`sweep_latency` (chapter 8):
  latency distributions side by side, with a percentile and an SLO to drag.
* :func:`~minibatch_engine.book.memory_calculator.memory_explorer` (chapter 13):
  model, attention variant, KV and weight dtypes, context and GPUs -> the
  largest batch and a decode step's time.
* :func:`deploy_explorer` (chapter 14): model, GPU, TP, PP and rate -> the
  planner's GPUs, p90 TTFT and TPOT, and cost per million output tokens.
"""
from .base import Explorable
from .blocks import block_explorer, block_run
from .deploy import deploy_explorer
from .eta import eta_explorer
from .latency import latency_explorer, policy_latency, sweep_latency
from .timeline import (
    itl_check,
    itl_panel,
    preemption_check,
    preemption_panel,
    step_scrubber,
    totals_check,
    trace_panel,
)

__all__ = ["Explorable", "block_explorer", "block_run", "deploy_explorer", "eta_explorer", "itl_check", "itl_panel", "latency_explorer",
           "policy_latency", "preemption_check", "preemption_panel", "step_scrubber",
           "sweep_latency", "totals_check", "trace_panel"]
