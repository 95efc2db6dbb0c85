"""tools/check_site.py on small handmade sites: it must flag code wider than
its box (the 1280 px overflow check), a widget manager loaded where no widget
is, and reference pages too wide for a phone or too long in print; and pass
the pages that fit."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")

pytestmark = [
    pytest.mark.slow,                   # make test-slow: a browser
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no browser at {CHROMIUM}"),
]

PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>
<style>.bd-article {{ width: 600px }} pre {{ overflow-x: auto; margin: 0 }}</style>{head}</head>
<body><main><article class="bd-article">
<div class="cell_input"><div class="highlight"><pre>{source}</pre></div></div>
<details><summary>hidden</summary>
<div class="cell_output"><div class="output"><pre>{output}</pre></div></div></details>
</article></main></body></html>"""

REF_PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>
<style>.bd-article {{ width: {width} }} p {{ margin: 0 0 1em }}</style></head>
<body><main><article class="bd-article"><section id="{title}">
{body}
</section></article></main></body></html>"""


def code_page(title: str, output: str = "x = 1", head: str = "") -> str:
    return PAGE.format(title=title, source="x = 1", output=output, head=head)


def check_site(tmp_path: Path, files: dict[str, str]) -> tuple[int, str]:
    """Write ``files`` (path under the site -> text), run tools/check_site.py on
    them: its exit status and its report."""
    pytest.importorskip("playwright")
    site = tmp_path / "html"
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_site.py"), str(site),
                           "--screenshots", str(tmp_path / "shots"), "--chromium", CHROMIUM],
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def verdict(report: str, page: str) -> str:
    """A page's row in the report: "ok" or "FAIL"."""
    row = next(ln for ln in report.splitlines() if ln.startswith(page + " "))
    return "ok" if row.rstrip().endswith("ok") else "FAIL" if "FAIL" in row else row


def test_overflowing_code_and_an_unused_widget_manager_fail_and_fitting_code_passes(tmp_path: Path):
    wide = "y = [" + ", ".join(str(i) for i in range(60)) + "]"  # ~230 columns
    rc, out = check_site(tmp_path, {
        "index.html": code_page("fits"),
        "wide.html": code_page("wide", output=wide),
        "manager.html": code_page("manager", head='<script src="embed-amd.js"></script>'),
        "embed-amd.js": "",
    })
    assert rc == 1, out
    assert (verdict(out, "index.html"), verdict(out, "wide.html"), verdict(out, "manager.html")) == \
        ("ok", "FAIL", "FAIL"), out
    # the collapsed output was opened and measured; the report names where and what
    assert "code wider than its box at 1280 px (cell output" in out, out
    assert "'y = [0, 1, 2" in out, out
    assert "loads the widget manager (embed-amd.js) but shows no widget" in out, out


def test_reference_pages_are_checked_on_a_phone_and_in_print(tmp_path: Path):
    """A reference page wider than a 390 px phone fails, as does one that prints
    on more sheets than allowed (the cheat sheet: 2); one that fits passes."""
    long_text = "\n".join(f"<p>line {i} of a long page</p>" for i in range(400))
    rc, out = check_site(tmp_path, {
        "index.html": code_page("fits"),
        "book/cheat_sheet.html": REF_PAGE.format(title="cheat-sheet", width="600px", body=long_text),
        "book/glossary.html": REF_PAGE.format(title="glossary", width="auto", body="<p>a short page that fits</p>"),
    })
    assert rc == 1, out
    assert (verdict(out, "book/glossary.html"), verdict(out, "book/cheat_sheet.html")) == ("ok", "FAIL"), out
    assert "phone (390 px): the page is" in out, out
    assert re.search(r"print: \d+ A4 pages, more than 2", out), out


# A tqdm bar as the widget manager draws it (ipywidgets 8: an HBox of an HTML
# label, a progress widget and an HTML label), inside a cell of a given class.
BAR_CELL = """<div class="cell {tags}"><div class="cell_output"><div class="output">
<div class="widget-subarea"><div class="jupyter-widgets widget-container widget-box widget-hbox">
<div class="jupyter-widgets widget-html"><div class="widget-html-content">T: 100%</div></div>
<div class="jupyter-widgets widget-hprogress widget-inline-hbox"><div class="progress">
<div class="progress-bar" style="width: 100%; height: 100%"></div></div></div>
<div class="jupyter-widgets widget-html"><div class="widget-html-content"> 9/9 [00:06&lt;00:00, 2.17it/s]</div></div>
</div></div></div></div></div>"""


def test_a_progress_bar_left_on_a_page_fails_and_a_hidden_one_passes(tmp_path: Path):
    """The site's own stylesheet hides a bar in a cell tagged hide-progress;
    a bar in an untagged cell, widget or tqdm's text, fails the page."""
    css = f"<style>{(ROOT / 'book' / 'site' / 'book.css').read_text()}</style>"

    def page(title: str, body: str) -> str:
        return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>{css}</head>'
                f'<body><main><article class="bd-article">{body}</article></main></body></html>')
    text_bar = ('<div class="cell"><div class="cell_output"><div class="output">'
                '<pre>sweep: 100%|██████████| 6/6 [00:10&lt;00:00,  2.24s/rate]\nrate 1: ok</pre></div></div></div>')
    rc, out = check_site(tmp_path, {
        "index.html": page("hidden", BAR_CELL.format(tags="tag_hide-progress")),
        "bar.html": page("bar", BAR_CELL.format(tags="")),
        "text.html": page("text", text_bar),
    })
    assert rc == 1, out
    assert (verdict(out, "index.html"), verdict(out, "bar.html"), verdict(out, "text.html")) == \
        ("ok", "FAIL", "FAIL"), out
    assert "a progress bar shows (tag its cell hide-progress): 'T: 100% 9/9 [00:06<00:00, 2.17it/s]'" in out, out
    assert "a progress bar shows (tag its cell hide-progress): '100%|██████████| 6/6'" in out, out
