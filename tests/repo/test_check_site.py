"""tools/check_site.py on a two-page handmade site: it must flag code wider than
its box (the 1280 px overflow check) and pass a page whose code fits."""
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
<style>.bd-article {{ width: 600px }} pre {{ overflow-x: auto; margin: 0 }}</style></head>
<body><main><article class="bd-article">
<div class="cell_input"><div class="highlight"><pre>{source}</pre></div></div>
<details><summary>hidden</summary>
<div class="cell_output"><div class="output"><pre>{output}</pre></div></div></details>
</article></main></body></html>"""


def test_overflowing_code_fails_and_fitting_code_passes(tmp_path: Path):
    pytest.importorskip("playwright")
    site = tmp_path / "html"
    site.mkdir()
    short = "x = 1"
    (site / "index.html").write_text(PAGE.format(title="fits", source=short, output=short))
    wide = "y = [" + ", ".join(str(i) for i in range(60)) + "]"  # ~230 columns
    (site / "wide.html").write_text(PAGE.format(title="wide", source=short, output=wide))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_site.py"), str(site),
                           "--screenshots", str(tmp_path / "shots"), "--chromium", CHROMIUM],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    lines = out.splitlines()
    assert any(ln.startswith("index.html") and ln.rstrip().endswith("ok") for ln in lines), out
    assert any(ln.startswith("wide.html") and "FAIL" in ln for ln in lines), out
    # the collapsed output was opened and measured; the report names where and what
    assert "code wider than its box at 1280 px (cell output" in out, out
    assert "'y = [0, 1, 2" in out, out


REF_PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title>
<style>.bd-article {{ width: {width} }} p {{ margin: 0 0 1em }}</style></head>
<body><main><article class="bd-article"><section id="{title}">
{body}
</section></article></main></body></html>"""


def test_reference_pages_are_checked_on_a_phone_and_in_print(tmp_path: Path):
    """A reference page wider than a 390 px phone fails, as does one that prints
    on more sheets than allowed (the cheat sheet: 2); one that fits passes."""
    pytest.importorskip("playwright")
    site = tmp_path / "html"
    (site / "book").mkdir(parents=True)
    (site / "index.html").write_text(PAGE.format(title="fits", source="x = 1", output="x = 1"))
    long_text = "\n".join(f"<p>line {i} of a long page</p>" for i in range(400))
    (site / "book" / "cheat_sheet.html").write_text(
        REF_PAGE.format(title="cheat-sheet", width="600px", body=long_text))
    (site / "book" / "glossary.html").write_text(
        REF_PAGE.format(title="glossary", width="auto", body="<p>a short page that fits</p>"))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_site.py"), str(site),
                           "--screenshots", str(tmp_path / "shots"), "--chromium", CHROMIUM],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    lines = out.splitlines()
    assert any(ln.startswith("book/glossary.html") and ln.rstrip().endswith("ok") for ln in lines), out
    assert any(ln.startswith("book/cheat_sheet.html") and "FAIL" in ln for ln in lines), out
    assert "phone (390 px): the page is" in out, out
    assert re.search(r"print: \d+ A4 pages, more than 2", out), out
