#!/usr/bin/env python3
"""Issue 29's edits to files other workers also edit; re-appliable (running it
twice changes nothing). ``--notebooks`` also edits chapters 3 and 7's tables
(then re-execute those two chapters).

book/interview_guide.md: every question/answer/evidence table becomes a list of
folded dropdowns (a self-test: the answer opens when asked; on a phone no
three-column table runs off the screen), the card is explained, and its two
Chinese questions lead with their English rendering.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent
GUIDE = ROOT / "book" / "interview_guide.md"
CHEAT = ROOT / "book" / "cheat_sheet.md"
GLOSSARY = ROOT / "book" / "glossary.md"
# an inline formula cannot wrap: at 390 px this one ran off the screen; in two
# pieces it breaks between them
KV_OLD = r"$2 \times \text{layers} \times \text{kv\_heads} \times \text{head\_dim} \times \text{bytes per element}$"
KV_NEW = r"$2 \times \text{layers} \times \text{kv\_heads}$ $\times\, \text{head\_dim} \times \text{bytes per element}$"

CARD_OLD = """The card on continuous batching (static vs continuous batching, KV cache and
inference optimisation) ends with four follow-up questions, two in Chinese and
two in English."""
CARD_NEW = """"The interview card" is the one-page study card this book grew from: a
bilingual (Chinese and English) summary of static against continuous batching,
from a series on KV caches and inference optimisation, with a one-sentence
conclusion, key points, a derivation and common pitfalls. It ends with four
follow-up questions, two in Chinese and two in English; each Chinese question
is given here in English first, with the original after it."""

INTRO_OLD = """whose cells measure it. The chapters' own interview sections carry the longer
worked answers."""
INTRO_NEW = """whose cells measure it. The chapters' own interview sections carry the longer
worked answers. Use it as a self-test: each answer is folded under its
question; answer aloud, then open it."""

CHINESE = {
    # a long inline formula cannot wrap: two halves can, on a phone
    '"$\\eta = \\sum (L^\\text{prompt} + L^\\text{gen}) / (B \\max (L^\\text{prompt} + L^\\text{gen}))$"':
        '"$\\eta = \\sum (L^\\text{prompt} + L^\\text{gen})$ / $(B \\max (L^\\text{prompt} + L^\\text{gen}))$"',
    "为什么连续批能大幅提升吞吐？ Why does continuous batching raise throughput so much?":
        "Why does continuous batching raise throughput so much? (为什么连续批能大幅提升吞吐？)",
    "连续批与 PagedAttention 的关系？ What is the relation between continuous batching and PagedAttention?":
        "What is the relation between continuous batching and PagedAttention? (连续批与 PagedAttention 的关系？)",
}


def split_row(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` stays inside a cell)."""
    body = line.strip()[1:-1]
    cells, cur, i = [], "", 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body) and body[i + 1] == "|":
            cur += "\\|"
            i += 2
            continue
        if body[i] == "|":
            cells.append(cur.strip())
            cur = ""
        else:
            cur += body[i]
        i += 1
    cells.append(cur.strip())
    return cells


def tables_to_dropdowns(text: str) -> str:
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if (line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|(\s*-+\s*\|)+\s*$", lines[i + 1])):
            header = [c.lower() for c in split_row(line)]
            i += 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(split_row(lines[i]))
                i += 1
            answer_label = header[1][0].upper() + header[1][1:] if len(header) > 1 else "Answer"
            for row in rows:
                q, a, ev = (row + ["", "", ""])[:3]
                q = q.replace("\\|", "|")
                # a colon fence: a backtick fence's info string may not hold a backtick
                out += [f"::::{{dropdown}} {q}", a.replace("\\|", "|"), ""]
                if ev:
                    out += [f"*Evidence:* {ev.replace(chr(92) + '|', '|')}", ""]
                out[-1:] = ["::::", ""]
            if out and out[-1] == "" and i < len(lines) and lines[i] == "":
                out.pop()
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def edit_guide() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    new = text.replace(CARD_OLD, CARD_NEW)
    if INTRO_NEW not in new:
        new = new.replace(INTRO_OLD, INTRO_NEW)
    for old, repl in CHINESE.items():
        new = new.replace(old, repl)
    new = tables_to_dropdowns(new)
    if new != text:
        GUIDE.write_text(new, encoding="utf-8")
        print(f"edited {GUIDE.relative_to(ROOT)}")


def stack_paired_formulas(text: str) -> str:
    """A display formula made of two halves side by side (``a \\qquad b``, the
    ``\\qquad`` on a line of its own) becomes the two stacked
    (``\\begin{gathered} a \\\\ b \\end{gathered}``): half the width, so it
    fits the page at 1280 px and scrolls less on a phone."""
    def one(m: re.Match) -> str:
        body = m.group(1)
        if "\\begin{gathered}" in body or not re.search(r"^\\qquad$", body, re.M):
            return m.group(0)
        parts = [p.strip("\n") for p in re.split(r"^\\qquad$", body, flags=re.M)]
        return "$$\n\\begin{gathered}\n" + "\n\\\\\n".join(parts) + "\n\\end{gathered}\n$$"
    return re.sub(r"^\$\$\n(.*?)\n\$\$", one, text, flags=re.S | re.M)


def edit_cheat_sheet() -> None:
    text = CHEAT.read_text(encoding="utf-8")
    new = stack_paired_formulas(text)
    new = new.replace("One page to print: the formulas", "Two sides to print: the formulas")
    if new != text:
        CHEAT.write_text(new, encoding="utf-8")
        print(f"edited {CHEAT.relative_to(ROOT)}")


def edit_glossary() -> None:
    text = GLOSSARY.read_text(encoding="utf-8")
    new = text.replace(KV_OLD, KV_NEW)
    if new != text:
        GLOSSARY.write_text(new, encoding="utf-8")
        print(f"edited {GLOSSARY.relative_to(ROOT)}")


# Chapter tables that showed raw keys (ch. 3) and a `nan` (ch. 7). Exact source
# replacements; the lead re-executes the two chapters after applying them.
NOTEBOOK_EDITS = {
    "chapters/03_continuous_batching.ipynb": [(
        """keys = ["steps", "eta", "computed_tokens", "batch_utilization", "peak_running",
        "sim_seconds", "sim_output_tokens_per_second"]
tps = "sim_output_tokens_per_second"
Table(
    [[k, *(f"{res[s][k]:,.0f} tok/s" if k == tps else res[s][k] for s in res)]
     for k in keys],
    ["", "static", "continuous"],
)""",
        """labels = {"steps": "engine steps", "eta": "η", "computed_tokens": "token rows computed",
          "batch_utilization": "batch utilisation", "peak_running": "most running at once",
          "sim_seconds": "simulated time (s)",
          "sim_output_tokens_per_second": "simulated output throughput"}
tps = "sim_output_tokens_per_second"
Table(
    [[label, *(f"{res[s][k]:,.0f} tok/s" if k == tps else res[s][k] for s in res)]
     for k, label in labels.items()],
    ["", "static", "continuous"],
)""")],
    "chapters/07_scheduling_policies.ipynb": [(
        """            bound - 1.0,
            np.percentile(inter_ttft, 99),""",
        """            bound - 1.0 if ahead else "none (no aging)",
            np.percentile(inter_ttft, 99),""")],
}


def edit_notebooks() -> None:
    import json
    for rel, edits in NOTEBOOK_EDITS.items():
        path = ROOT / rel
        nb = json.loads(path.read_text(encoding="utf-8"))
        changed = False
        for old, new in edits:
            hits = [c for c in nb["cells"] if old in "".join(c["source"])]
            if not hits:
                if not any(new in "".join(c["source"]) for c in nb["cells"]):
                    print(f"{rel}: neither the old nor the new source found: skipped")
                continue
            assert len(hits) == 1, f"{rel}: the old source is in {len(hits)} cells"
            text = "".join(hits[0]["source"]).replace(old, new)
            hits[0]["source"] = text.splitlines(keepends=True)
            changed = True
        if changed:
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"edited {rel} (re-execute it)")


if __name__ == "__main__":
    import sys
    if "--notebooks" in sys.argv:
        edit_notebooks()
    edit_guide()
    edit_cheat_sheet()
    edit_glossary()
