"""Explorables: the chapters' figures a reader can drag, on the static site
(no kernel, no network) and in JupyterLab. Each is one HTML output built from
a chapter's own runs (:mod:`.base`); the browser only does arithmetic on that
data, and ``tools/check_explorables.py`` checks every control and every
number it computes against Python's.

* :func:`eta_explorer` (chapter 2): σ and B -> η, the padded layout drawn.
"""
from .base import Explorable
from .eta import eta_explorer

__all__ = ["Explorable", "eta_explorer"]
