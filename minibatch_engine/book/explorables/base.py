"""What every explorable shares: one HTML output that carries its data and its
JavaScript, so it works on the static site (no kernel, no network) and in
JupyterLab once the cell has run.

An explorable is ``<div class="mbe-explorable" id="mbe-NAME" data-kind=KIND>``
holding its data as JSON, the runtime (``static/base.js``), its kind's script
(``static/KIND.js``) and the shared style sheet, all inlined from the package.
The id comes from the explorable's name, never from a random number, so a
re-run stores the same HTML and nbval compares it like any other output.

``data-checks`` lists settings of the controls and the figures the page must
then show, computed here in Python with the chapter's own functions; the
browser check (``tools/check_explorables.py``) sets each control, reads the
``data-value`` of each output and compares.
"""
from __future__ import annotations

import html
import json
import math
import re
from importlib import resources
from typing import Any, Mapping, Sequence

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
FALLBACK = ("Interactive figure: it runs in the browser. In JupyterLab, run this cell "
            "(or trust the notebook) to use it.")


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def rounded(x: Any, digits: int = 6) -> Any:
    """Floats rounded to ``digits`` significant figures, through lists and dicts:
    the stored HTML then does not depend on a machine's last bits."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v, digits) for v in x]
    if hasattr(x, "item") and getattr(x, "ndim", None) == 0:
        return rounded(x.item(), digits)
    return x


class Explorable:
    """An HTML output that Jupyter and the book both display (``_repr_html_``).

    ``name``: its id on the page (lowercase, digits, dashes; unique in a
    chapter); ``kind``: which ``static/KIND.js`` draws it; ``data``: JSON for
    that script; ``checks``: ``[{"set": {control: value}, "expect": {output:
    number}}]`` for the browser check; ``title``: a line above it."""

    def __init__(self, name: str, kind: str, data: Mapping, checks: Sequence[Mapping] = (),
                 title: str = ""):
        if not _NAME.match(name):
            raise ValueError(f"explorable name {name!r}: use lowercase letters, digits and dashes")
        if not resources.files(__package__).joinpath("static", f"{kind}.js").is_file():
            raise ValueError(f"explorable kind {kind!r}: no static/{kind}.js in {__package__}")
        self.name, self.kind, self.title = name, kind, title
        self.data, self.checks = rounded(dict(data)), rounded(list(checks))

    def _repr_html_(self) -> str:
        root = f"mbe-{self.name}"
        data = json.dumps(self.data, separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")
        checks = html.escape(json.dumps(self.checks, separators=(",", ":")), quote=True)
        script = _asset("base.js") + "\n" + _asset(f"{self.kind}.js") + f'\nwindow.MBE.mount("{root}", document.currentScript);\n'
        title = f'<div class="mbe-title">{html.escape(self.title)}</div>' if self.title else ""
        return (f'<div class="mbe-explorable" id="{root}" data-kind="{self.kind}" '
                f'data-checks="{checks}">\n<style>\n{_asset("explorables.css")}</style>\n{title}'
                f'<p class="mbe-fallback">{FALLBACK}</p>\n'
                f'<script type="application/json" class="mbe-data">{data}</script>\n'
                f"<script>\n{script}</script>\n</div>")

    def __repr__(self) -> str:
        return f"<explorable {self.name}: {self.title or self.kind}>"
