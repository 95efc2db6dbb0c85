"""Sphinx extension: serve the book's browser libraries from the built site.

Jupyter Book 1.x pages load MathJax 3, require.js and the Jupyter widgets HTML
manager (``@jupyter-widgets/html-manager``, ``embed-amd.js``) from CDNs by
default.  Offline, math stays raw TeX and widget areas stay blank.  This
extension copies the files that ``npm ci`` put in ``node_modules/`` (versions
pinned in ``package.json`` / ``package-lock.json``; ``make site-assets``), and
book/site/widgets-setup.js, into ``_build/html/_static/npm/``; ``_config.yml`` points ``mathjax_path`` and
``nb_ipywidgets_js`` there (relative script paths resolve under ``_static/``).

The copy runs at ``builder-inited`` so that the files exist when the pages are
written, and Sphinx appends its ``?v=<checksum>`` cache-buster to them.

A page loads the widget manager only when it shows a widget: myst-nb adds the
manager and the notebook's saved widget state to every page whose notebook
metadata holds widget state, even when no output shows a widget (a widget
closed or cleared before the notebook was saved leaves its state behind).

Nothing third-party is committed: ``node_modules/`` is git-ignored, and a
missing install stops the build with the command that fixes it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util import logging

logger = logging.getLogger(__name__)

#: what goes where: destination under ``_static/npm/`` -> (npm package,
#: paths inside the package).  A directory is copied whole.
ASSETS: dict[str, tuple[str, list[str]]] = {
    # The single entry point that Sphinx loads, plus everything it may load
    # lazily at read time: TeX extensions (autoload), the CHTML fonts, the
    # SVG renderer and the accessibility tools (both selectable in MathJax's
    # right-click menu), the speech rule engine's maps.
    "mathjax": (
        "mathjax",
        [
            "es5/tex-mml-chtml.js",
            "es5/input",
            "es5/output",
            "es5/ui",
            "es5/a11y",
            "es5/sre",
            "es5/adaptors",
            "LICENSE",
        ],
    ),
    "requirejs": ("requirejs", ["require.js"]),
    # require.js and html-manager ship no LICENSE file: require.js carries its
    # MIT header; embed.js.LICENSE.txt lists the bundled packages' licenses
    # (html-manager itself is BSD-3-Clause, see its package.json).
    # embed-amd.js bundles the manager, @jupyter-widgets/base, controls and
    # output; its Font Awesome files sit beside it (webpack public path).
    "html-manager": (
        "@jupyter-widgets/html-manager",
        [
            "dist/embed-amd.js",
            "dist/embed.js.LICENSE.txt",
            "dist/*.woff2",
            "dist/*.woff",
            "dist/*.ttf",
            "dist/*.eot",
            "dist/*.svg",
        ],
    ),
}

#: our own small scripts and styles, committed under book/site/
OWN_FILES = {"html-manager": ["widgets-setup.js"], "book": ["book.css"]}


def _copy_file(src: Path, dst: Path) -> None:
    if dst.exists():
        s, d = src.stat(), dst.stat()
        if s.st_size == d.st_size and s.st_mtime_ns <= d.st_mtime_ns:
            return
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def _copy(src: Path, dst: Path) -> int:
    if src.is_dir():
        n = 0
        for f in src.rglob("*"):
            if f.is_file():
                _copy_file(f, dst / f.relative_to(src))
                n += 1
        return n
    _copy_file(src, dst)
    return 1


def copy_vendor_assets(app: Sphinx) -> None:
    if app.builder.format != "html":
        return
    root = Path(app.srcdir)
    modules = root / "node_modules"
    vendor = Path(app.outdir) / "_static" / "npm"
    missing = [pkg for pkg, _ in ASSETS.values() if not (modules / pkg / "package.json").is_file()]
    if missing:
        raise ExtensionError(
            "offline_assets: npm packages missing from node_modules/: "
            + ", ".join(missing)
            + ". Run `make site-assets` (npm ci) at the repository root."
        )
    count = 0
    for dest, (pkg, members) in ASSETS.items():
        for member in members:
            base = modules / pkg
            if "*" in member:
                sources = sorted(base.glob(member))
            else:
                sources = [base / member]
            for src in sources:
                if not src.exists():
                    raise ExtensionError(f"offline_assets: {src} not found (package layout changed?)")
                # drop the package's own top folder (es5/, dist/) in the copy
                rel = Path(*Path(member).parts[1:]) if len(Path(member).parts) > 1 else Path(member)
                target = vendor / dest / (rel.parent / src.name if "*" in member else rel)
                count += _copy(src, target)
    here = root / "book" / "site"
    for dest, names in OWN_FILES.items():
        for name in names:
            count += _copy(here / name, vendor / dest / name)
    logger.info("offline_assets: %d files in %s", count, vendor)


def _thebe_enabled(app: Sphinx) -> bool:
    launch = (app.config.html_theme_options or {}).get("launch_buttons") or {}
    thebe_config = getattr(app.config, "thebe_config", None) or {}
    return bool(launch.get("thebe")) or (
        isinstance(thebe_config, dict) and str(thebe_config.get("always_load")) in ("True", "true")
    )


def tidy_page_scripts(app: Sphinx, pagename, templatename, context, doctree) -> None:
    """Drop sphinx-thebe's page scripts while the book has no thebe button.

    Jupyter Book always loads sphinx-thebe, which adds an inline script
    ``const THEBE_JS_URL = "https://unpkg.com/thebe@0.8.2/..."`` to every page.
    With Sphinx 7.4 it lands on each page twice (once through the registry,
    once through the builder), and the second ``const`` throws "Identifier
    'THEBE_JS_URL' has already been declared" on every page load.  The URL is
    a CDN, used only by the "Live code" launch button (``launch_buttons:
    thebe: true``), which this book does not enable: then the scripts are
    dead code and go.  With thebe on, only the duplicate goes.
    """
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    thebe_on = _thebe_enabled(app)
    keep, seen = [], set()
    for js in scripts:
        attrs = getattr(js, "attributes", {}) or {}
        body = attrs.get("body") or ""
        filename = str(getattr(js, "filename", "") or "")
        if not thebe_on and ("THEBE_JS_URL" in body or filename.endswith("sphinx-thebe.js")):
            continue
        if body and not filename:
            if body in seen:
                continue
            seen.add(body)
        keep.append(js)
    scripts[:] = keep  # in place: the builder resets this list for every page


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def shows_widget(doctree) -> bool:
    """Whether a page's doctree holds a widget view (myst-nb renders one as a raw
    ``<script type="application/vnd.jupyter.widget-view+json">``)."""
    return doctree is not None and any(WIDGET_VIEW in n.astext() for n in doctree.findall(nodes.raw))


def widgets_only_where_shown(app: Sphinx, pagename, templatename, context, doctree) -> None:
    """Drop the widget manager's scripts (``nb_ipywidgets_js``) and the saved
    widget state from a page that shows no widget (the module doc)."""
    scripts = context.get("script_files")
    if not isinstance(scripts, list) or shows_widget(doctree):
        return
    manager = {str(path) for path in getattr(app.config, "nb_ipywidgets_js", None) or {}}

    def widget_script(js) -> bool:
        filename = str(getattr(js, "filename", "") or "").split("?", 1)[0].removeprefix("_static/")
        return filename in manager or (getattr(js, "attributes", {}) or {}).get("type") == WIDGET_STATE
    scripts[:] = [js for js in scripts if not widget_script(js)]  # in place, as tidy_page_scripts


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", copy_vendor_assets)
    app.connect("html-page-context", tidy_page_scripts, priority=900)
    app.connect("html-page-context", widgets_only_where_shown, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
