"""The chapters as JupyterLab shows them: glued numbers filled in, Sphinx-only
roles made readable, and nothing that marks a notebook modified on opening.

The book's prose takes its numbers from the cells above through MyST glue
(``{glue:text}`name:.1f```), which Jupyter Book resolves when it builds the site.
JupyterLab (even with ``jupyterlab-myst``, which renders the directives:
dropdowns, admonitions, math) does not know the glue role, nor ``{term}``,
``{cite}`` and ``{ref}``, which need the whole book. :func:`for_lab` rewrites a
notebook's markdown cells for reading: each glue role becomes the value the
site shows (the stored output of the cell that glued it, formatted as
``myst_nb`` formats it), ``{term}``/``{ref}`` become their text and ``{cite}``
becomes "(Author year)". The original source is kept in the cell's metadata,
and :func:`from_lab` puts it back, so saving the notebook from Lab writes the
same file (a cell the reader edited keeps the edit).

``make lab`` serves the chapters through :class:`BookContentsManager`
(``minibatch_engine.book.lab_server``), which applies :func:`for_lab` when
Lab opens a notebook and :func:`from_lab` when it saves one. This module only
needs ``nbformat``-shaped dicts; it imports nothing from Jupyter.
"""
from __future__ import annotations

import copy
import json
import platform
import re
from ast import literal_eval
from pathlib import Path
from typing import Any, Callable, Mapping

#: metadata key (cell and notebook) under which the original text is kept
META = "minibatch_engine_lab"
GLUE_PREFIX = "application/papermill.record/"

_ROLE = re.compile(r"\{(glue|glue:text|term|ref|cite|cite:p|cite:t)\}`([^`]+)`")
_TARGET = re.compile(r"^(.*?)\s*<([^<>]+)>$", re.S)
#: what the ipykernel kernel reports: Lab writes these on kernel start
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def format_plain_text(text: str, fmt_spec: str) -> str:
    """A glued ``text/plain`` value formatted as ``myst_nb`` does for
    ``{glue:text}`key:spec``` (so Lab shows what the site shows)."""
    try:
        value = literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    if fmt_spec == "":
        return str(value)
    kind = fmt_spec[-1]
    if kind == "s":
        value = str(value)
    elif kind in "bcdoxX":
        value = int(value)
    elif kind in "eEfFgGn%":
        value = float(value)
    return format(value, fmt_spec)


def _source(cell: Mapping) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def glue_values(nb: Mapping) -> dict[str, str]:
    """``name -> text/plain`` of every value the notebook's stored outputs glue."""
    out = {}
    for cell in nb.get("cells", []):
        for o in cell.get("outputs", []) or []:
            scrap = (o.get("metadata") or {}).get("scrapbook")
            if not scrap:
                continue
            prefix = scrap.get("mime_prefix", "")
            data = o.get("data") or {}
            text = data.get(prefix + "text/plain", data.get("text/plain"))
            if text is not None:
                out[scrap["name"]] = "".join(text) if isinstance(text, list) else text
    return out


def _bib_labels(bib: Path | None) -> dict[str, str]:
    """``key -> "Author et al. year"`` from a BibTeX file (first author's surname)."""
    if bib is None or not bib.exists():
        return {}
    labels = {}
    for entry in re.split(r"\n@", "\n" + bib.read_text(encoding="utf-8")):
        m = re.match(r"\s*\w+\s*\{\s*([^,\s]+)\s*,", entry)
        if not m:
            continue
        author = re.search(r"\bauthor\s*=\s*[{\"](.+?)[}\"]\s*,?\s*\n", entry, re.S | re.I)
        year = re.search(r"\byear\s*=\s*[{\"]?(\d{4})", entry, re.I)
        who = ""
        if author:
            names = re.split(r"\s+and\s+", " ".join(author.group(1).split()))
            first = names[0].replace("{", "").replace("}", "")
            who = (first.split(",")[0] if "," in first else first.split()[-1]) + (
                " et al." if len(names) > 1 else "")
        labels[m.group(1)] = f"{who} {year.group(1)}".strip() if year else who or m.group(1)
    return labels


def render_roles(text: str, values: Mapping[str, str], *, other: Callable[[str], Mapping[str, str]]
                 | None = None, cite_labels: Mapping[str, str] | None = None) -> str:
    """``text`` with every glue role replaced by its formatted value and
    ``{term}``, ``{ref}``, ``{cite}`` by readable text. A glue name with no
    stored value raises ``KeyError`` naming it (the notebook has not been run)."""
    cite_labels = cite_labels or {}

    def one(m: re.Match) -> str:
        role, body = m.group(1), m.group(2)
        if role.startswith("glue"):
            key, spec = (body.rsplit(":", 1) + [""])[:2] if role == "glue:text" and ":" in body \
                else (body, "")
            table = values
            if "::" in key:
                if other is None:
                    raise KeyError(f"glue {key!r} names another document")
                doc, key = key.split("::", 1)
                table = other(doc)
            if key not in table:
                raise KeyError(f"no stored glue value {key!r} (run the notebook's cells first)")
            return format_plain_text(table[key], spec)
        if role in ("term", "ref"):
            t = _TARGET.match(body)
            return t.group(1) if t else body
        keys = [k.strip() for k in body.split(",")]
        return "(" + "; ".join(cite_labels.get(k, k) for k in keys) + ")"
    return _ROLE.sub(one, text)


def for_lab(nb: Mapping, *, where: Path | None = None, bib: Path | None = None,
            python_version: str | None = None) -> dict:
    """A copy of notebook ``nb`` (a dict) to show in JupyterLab: markdown roles
    rendered (see :func:`render_roles`; the original source kept in the cell's
    metadata), and the kernel metadata Lab rewrites on kernel start set to what
    it will write (the committed values kept in the notebook's metadata).
    ``where`` is the notebook's folder (for cross-document glue);
    ``python_version`` the kernel's (default: this Python's)."""
    nb = copy.deepcopy(dict(nb))
    values = glue_values(nb)
    cache: dict[str, Mapping[str, str]] = {}

    def other(doc: str) -> Mapping[str, str]:
        if doc not in cache:
            path = (where or Path(".")) / doc
            cache[doc] = glue_values(json.loads(path.read_text(encoding="utf-8")))
        return cache[doc]
    labels = _bib_labels(bib)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        src = _source(cell)
        if not _ROLE.search(src):
            continue
        try:
            shown = render_roles(src, values, other=other, cite_labels=labels)
        except KeyError:
            continue    # not executed yet: leave the cell as written
        cell["source"] = shown
        cell.setdefault("metadata", {})[META] = {"source": src, "shown": shown}
    meta = nb.setdefault("metadata", {})
    kept = {}
    if meta.get("kernelspec", {}).get("name") == "python3" and meta["kernelspec"] != KERNELSPEC:
        kept["kernelspec"] = meta["kernelspec"]
        meta["kernelspec"] = dict(KERNELSPEC)
    info = meta.get("language_info")
    version = python_version or platform.python_version()
    if isinstance(info, dict) and info.get("name") == "python" and info.get("version") != version:
        kept["language_info"] = copy.deepcopy(info)
        info["version"] = version
    if kept:
        meta[META] = kept
    return nb


def from_lab(nb: Mapping) -> dict:
    """The inverse of :func:`for_lab`, for saving: each rendered cell the reader
    did not edit gets its original source back, and the committed kernel
    metadata returns. A cell that was edited keeps the edit (its glue roles,
    if any, are then the reader's to write back)."""
    nb = copy.deepcopy(dict(nb))
    for cell in nb.get("cells", []):
        meta = cell.get("metadata") or {}
        kept = meta.pop(META, None)
        if kept is None:
            continue
        if _source(cell) == kept["shown"]:
            cell["source"] = kept["source"]
    meta = nb.get("metadata") or {}
    meta.update(meta.pop(META, None) or {})
    return nb
