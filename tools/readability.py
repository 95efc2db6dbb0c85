"""How heavy each page of the book reads: mean sentence length and the share of long sentences.

The measure the book holds itself to (issue 39, DESIGN.md "Writing"): for every
chapter and notebook page, the mean sentence of its markdown prose is at most 22
words and at most 10% of its sentences run over 35 words. Code, display maths,
directive lines, tables and headings are left out (a glossary's definitions are
prose and count); a glued number or an inline
code span counts as one word. The same rule as the before-stop hook.

    python tools/readability.py                 # every notebook page and book/*.md
    python tools/readability.py chapters/03_continuous_batching.ipynb --long
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

MAX_MEAN = 22.0
MAX_LONG_SHARE = 0.10
LONG = 35


def prose_of_markdown(text: str) -> str:
    """The sentences of one markdown text, with code, maths, directives and tables removed."""
    text = re.sub(r"```\{glossary\}\n(.*?)```", r"\1", text, flags=re.S)  # definitions are prose
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"\$\$.*?\$\$", "", text, flags=re.S)
    text = re.sub(r"\{glue:text\}`[^`]*`", "N", text)
    text = re.sub(r"\{[a-z:]+\}`([^`<]*)(<[^>]*>)?`", r"\1", text)
    text = re.sub(r"`[^`]*`", "X", text)
    text = re.sub(r"^\s*[#:>|].*$", "", text, flags=re.M)
    return text


def page_prose(path: pathlib.Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n".join(prose_of_markdown("".join(c.get("source", "")))
                         for c in cells if c.get("cell_type") == "markdown")
    return prose_of_markdown(path.read_text())


def sentences(prose: str) -> list[str]:
    """Sentences of three words or more (shorter fragments are labels, not sentences)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", prose) if len(s.split()) > 2]


def measure(path: pathlib.Path) -> dict:
    sents = sentences(page_prose(path))
    lens = [len(s.split()) for s in sents]
    if not lens:
        return {"page": str(path), "sentences": 0, "words": 0, "mean": 0.0, "long_share": 0.0, "long": []}
    return {"page": str(path), "sentences": len(lens), "words": sum(lens),
            "mean": statistics.mean(lens), "long_share": sum(n > LONG for n in lens) / len(lens),
            "long": [s for s, n in zip(sents, lens) if n > LONG]}


def meets_target(m: dict) -> bool:
    return m["mean"] <= MAX_MEAN and m["long_share"] <= MAX_LONG_SHARE


def default_pages(root: pathlib.Path) -> list[pathlib.Path]:
    """Every page of the book: the chapters, book/'s notebook pages and book/*.md."""
    return (sorted(root.glob("chapters/*.ipynb")) + sorted(root.glob("book/*.ipynb"))
            + sorted(root.glob("book/*.md")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", type=pathlib.Path)
    ap.add_argument("--long", action="store_true", help="print every sentence over 35 words")
    args = ap.parse_args(argv)
    root = pathlib.Path(__file__).resolve().parent.parent
    pages = args.pages or default_pages(root)
    failed = 0
    print(f"{'page':<48} {'words':>6} {'mean':>5} {'>35':>5}")
    for p in pages:
        m = measure(p)
        ok = meets_target(m)
        failed += not ok
        print(f"{str(p)[-48:]:<48} {m['words']:>6} {m['mean']:>5.1f} {m['long_share']:>5.0%}"
              f"{'' if ok else '  over target'}")
        if args.long:
            for s in m["long"]:
                print(f"    [{len(s.split())}] {' '.join(s.split())}")
    print(f"target: mean <= {MAX_MEAN:g} words, <= {MAX_LONG_SHARE:.0%} of sentences over {LONG} words")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
