"""Cross-references in the book's prose point somewhere real.

Scans the back matter (``book/*.md``) and the chapters' markdown cells for:

* a reference to a chapter number that has no notebook (``chapter 8`` while
  there is no ``chapters/08_*.ipynb``), ranges and lists included
  ("chapters 2 to 4", "chapters 5 and 6");
* a plain-text "see chapter N" that is not a link: the words "chapter N" must
  sit inside a Markdown link or a ``{ref}``/``{doc}``/``{numref}`` role;
* a ``{ref}`` or ``[text](label)`` target in ``book/*.md`` with no MyST label
  ``(label)=`` anywhere in the book (the Sphinx build reports those too, but
  this names every missing label at once).

No torch, no build: it reads text only.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTER_FILES = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))
EXISTING = {int(p.name[:2]) for p in CHAPTER_FILES}
BOOK_PAGES = sorted([*(ROOT / "book").glob("*.md"), *(ROOT / "book").glob("*.ipynb")])

# "chapter 3", "Chapters 2 to 4", "chapters 5 and 6", "chapters 1, 2 and 3", "chapter 2–4"
CHAPTER_REF = re.compile(
    r"\b[Cc]hapters?\s+(\d+)((?:\s*(?:,|and|or|to|through|–|-)\s*\d+)*)")
SEE_CHAPTER = re.compile(r"\b[Ss]ee\s+(?:also\s+)?(?:in\s+)?([Cc]hapters?\s+\d+)")
# spans that are links: [text](target) and {ref}`...`, {doc}`...`, {numref}`...`
LINK_SPANS = re.compile(r"\[[^\]]*\]\([^)]*\)|\{(?:ref|doc|numref)\}`[^`]*`")
REF_ROLE = re.compile(r"\{(?:ref|numref)\}`(?:[^`<]*<([^`>]+)>|([^`<]+))`")
MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
LABEL_DEF = re.compile(r"^\s*\(([A-Za-z0-9_.:-]+)\)=\s*$", re.MULTILINE)


def _markdown_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text(encoding="utf-8"))
        return "\n\n".join("".join(c["source"]) for c in nb["cells"]
                           if c["cell_type"] == "markdown")
    return path.read_text(encoding="utf-8")


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _numbers(first: str, rest: str) -> list[int]:
    """The chapter numbers a match names; ranges ("2 to 4", "2–4") expanded."""
    nums, seps = [int(first)], re.findall(r"(,|and|or|to|through|–|-)\s*(\d+)", rest)
    for sep, n in seps:
        n = int(n)
        if sep in ("to", "through", "–", "-"):
            nums.extend(range(nums[-1] + 1, n + 1))
        else:
            nums.append(n)
    return nums


def missing_chapter_refs(text: str) -> list[str]:
    out = []
    for m in CHAPTER_REF.finditer(text):
        bad = [n for n in _numbers(m.group(1), m.group(2)) if n not in EXISTING]
        if bad:
            out.append(f"line {_line(text, m.start())}: {m.group(0)!r} "
                       f"(no chapters/{bad[0]:02d}_*.ipynb)")
    return out


def unlinked_see_chapter(text: str) -> list[str]:
    spans = [m.span() for m in LINK_SPANS.finditer(text)]
    out = []
    for m in SEE_CHAPTER.finditer(text):
        start = m.start(1)
        if not any(a <= start < b for a, b in spans):
            out.append(f"line {_line(text, m.start())}: {m.group(0)!r} is not a link")
    return out


def ref_targets(text: str) -> set[str]:
    targets = {a or b for a, b in REF_ROLE.findall(text)}
    for t in MD_LINK.findall(text):
        if "://" in t or t.startswith(("#", "mailto:")) or "/" in t or "." in t:
            continue  # URLs, in-page anchors and document paths are not labels
        targets.add(t)
    return {t.strip() for t in targets}


def all_labels() -> set[str]:
    labels = set()
    for p in [*CHAPTER_FILES, *BOOK_PAGES]:
        labels |= set(LABEL_DEF.findall(_markdown_of(p)))
    return labels


SOURCES = [*BOOK_PAGES, *CHAPTER_FILES]
IDS = [str(p.relative_to(ROOT)) for p in SOURCES]


def test_the_checks_catch_what_they_should():
    assert missing_chapter_refs("Chapter 99 studies load.")
    assert missing_chapter_refs("chapters 2 to 99") and not missing_chapter_refs(
        f"chapters {min(EXISTING)} and {max(EXISTING)}")
    assert unlinked_see_chapter("For more, see chapter 1.")
    assert not unlinked_see_chapter("For more, see [chapter 1](../chapters/01_x.ipynb).")
    assert not unlinked_see_chapter("For more, see {ref}`chapter 1 <ch1-kv-memory>`.")
    assert ref_targets("{ref}`text <a-label>` {ref}`b-label` [t](c-label) [u](x.ipynb)") \
        == {"a-label", "b-label", "c-label"}


@pytest.mark.parametrize("path", SOURCES, ids=IDS)
def test_chapter_references_exist(path):
    problems = missing_chapter_refs(_markdown_of(path))
    assert not problems, f"{path.name} refers to chapters that do not exist:\n" + \
        "\n".join(problems)


@pytest.mark.parametrize("path", SOURCES, ids=IDS)
def test_see_chapter_is_a_link(path):
    problems = unlinked_see_chapter(_markdown_of(path))
    assert not problems, f"{path.name} has plain-text cross-references:\n" + \
        "\n".join(problems)


@pytest.mark.parametrize("path", BOOK_PAGES, ids=[p.name for p in BOOK_PAGES])
def test_book_ref_labels_exist(path):
    missing = sorted(ref_targets(_markdown_of(path)) - all_labels())
    assert not missing, f"{path.name} links to labels no page defines: {missing}"
