"""``glue``: hand a value computed in a cell to the chapter's prose.

When the book is built, MyST-NB's ``glue`` stores the value in the notebook so
``{glue:text}`` roles in the prose show it. A reader running a chapter with
only the package and Jupyter installed (no ``myst_nb``) gets the same call,
which then simply displays the value.
"""
from __future__ import annotations


def glue(name: str, variable, display: bool = True) -> None:
    if hasattr(variable, "item") and getattr(variable, "ndim", None) == 0:
        variable = variable.item()      # a numpy/torch scalar: its Python value formats in prose
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        if display:
            from IPython.display import display as show
            show(variable)
        return
    myst_glue(name, variable, display=display)
