"""Every page of the book reads at the target the book sets itself.

The measure is `tools/readability.py`'s (the same rule as the repository's
before-stop hook): the markdown prose of each chapter, notebook page and
back-matter page, with code, display maths, directive lines, tables and
headings left out, has a mean sentence of at most 22 words and at most 10% of
its sentences over 35 words. No torch, no build: it reads text only.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("readability", ROOT / "tools" / "readability.py")
readability = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readability)

PAGES = readability.default_pages(ROOT)  # chapters, book/ notebooks, book/*.md


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_reads_at_the_target(page):
    m = readability.measure(page)
    longest = sorted(m["long"], key=len, reverse=True)[:3]
    assert readability.meets_target(m), (
        f"{page.name}: mean sentence {m['mean']:.1f} words (target <= {readability.MAX_MEAN:g}), "
        f"{m['long_share']:.0%} over {readability.LONG} words (target <= "
        f"{readability.MAX_LONG_SHARE:.0%}); longest: {longest}")


def test_the_measure_counts_what_a_reader_reads(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A heading that is not a sentence at all\n\n"
                    "One short sentence here. " + "word " * 40 + "ends here.\n\n"
                    "```python\nx = 'code is not prose, however long the line may be in words'\n```\n"
                    "| a | table | row | is | not | prose |\n")
    m = readability.measure(page)
    assert m["sentences"] == 2 and m["long_share"] == 0.5
    assert not readability.meets_target(m)
