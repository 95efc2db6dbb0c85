"""Issue 31 (explorables): the notebook edits, re-appliable on top of main.

Run from the repository root:  python edits_explore.py
Each edit finds its place by a unique string and is skipped when it is
already there, so running the script twice changes nothing. Then re-execute
the chapters it touched (chapter 3 and 8 are slow).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MARK = "explorable"  # every inserted code cell carries the tag "explorable"


def load(nb):
    return json.loads((ROOT / "chapters" / nb).read_text(encoding="utf-8"))


def save(nb, data):
    text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    (ROOT / "chapters" / nb).write_text(text, encoding="utf-8")


def src(cell):
    return "".join(cell["source"])


def lines(text):
    parts = text.strip("\n").split("\n")
    return [p + "\n" for p in parts[:-1]] + [parts[-1]]


def code(text, tags=()):
    return {"cell_type": "code", "execution_count": None, "id": None,
            "metadata": {"tags": [MARK, *tags]}, "outputs": [], "source": lines(text)}


def markdown(text):
    return {"cell_type": "markdown", "id": None, "metadata": {}, "source": lines(text)}


def find(data, needle, nb):
    hits = [i for i, c in enumerate(data["cells"]) if needle in src(c)]
    if len(hits) != 1:
        sys.exit(f"{nb}: {len(hits)} cells contain {needle!r} (need exactly one)")
    return hits[0]


def has(data, needle):
    return any(needle in src(c) for c in data["cells"])


def with_ids(data, name):
    """nbformat 4.5 cell ids for new cells, derived from the explorable's name."""
    used = {c.get("id") for c in data["cells"]}
    for k, c in enumerate(data["cells"]):
        if c.get("id") is None:
            base = f"{name}-{k}"
            while base in used:
                base += "x"
            c["id"] = base
            used.add(base)
    if data.get("nbformat_minor", 0) < 5:
        for c in data["cells"]:
            c.pop("id", None)


def insert_after(nb, data, needle, cells, name):
    """Insert cells after the one containing ``needle``, unless the first
    inserted cell's source is already in the notebook."""
    if has(data, src(cells[0]).strip()):
        print(f"{nb}: {name} already there")
        return
    i = find(data, needle, nb)
    data["cells"][i + 1:i + 1] = cells
    with_ids(data, name)
    print(f"{nb}: {name} inserted after cell {i}")


def replace_in(nb, data, old, new, name):
    """Replace an exact string in one cell (skipped when already replaced)."""
    if has(data, new) and not has(data, old):
        print(f"{nb}: {name} already there")
        return
    if not has(data, old):
        print(f"{nb}: WARNING {name}: {old[:60]!r} not found; left as it is")
        return
    i = find(data, old, nb)
    c = data["cells"][i]
    c["source"] = lines(src(c).replace(old, new))
    print(f"{nb}: {name} replaced in cell {i}")


# --- chapter 2: the dead sigma/B slider becomes an explorable -------------
CH2 = "02_static_batching.ipynb"
CH2_OLD_SLIDER = "@widgets.interact("
CH2_CELL = '''
def lengths_for(sigma, n=128):  # the requests behind eta_for(sigma, B)
    out = Constant(64) if sigma == 0 else LogNormal(64, sigma, 1, 900)
    specs = make_workload(WorkloadSpec(Constant(64), out, ""), n, seed=1)
    return [(len(s.prompt_token_ids), s.max_tokens) for s in specs]


eta_explorer(lengths_for, sigmas=np.arange(0, 2.001, 0.05), sigma=1.0, batch=16)
'''
CH2_PROSE_OLD = "Running the notebook locally, drag the sliders:"
CH2_PROSE_NEW = (
    "Drag $\\sigma$ and $B$ below: each row of the drawing is one request's lane,\n"
    "each band one static batch, and η is computed on the page from the same\n"
    "requests (the book's checks compare it with `eta_run`):")


def chapter2():
    data = load(CH2)
    if has(data, CH2_OLD_SLIDER):
        i = find(data, CH2_OLD_SLIDER, CH2)
        new = code(CH2_CELL)
        new["id"] = data["cells"][i].get("id", "ch2-eta-explorer")
        data["cells"][i] = new
        print(f"{CH2}: slider cell {i} replaced by the η explorable")
    else:
        print(f"{CH2}: η explorable already there")
    replace_in(CH2, data, CH2_PROSE_OLD, CH2_PROSE_NEW, "the sentence before it")
    imports = "from minibatch_engine.book.explorables import eta_explorer\n"
    c = data["cells"][find(data, "from minibatch_engine.book.efficiency import", CH2)]
    s = src(c)
    if imports not in s:
        s = s.replace("from minibatch_engine.book.report import Table\n",
                      "from minibatch_engine.book.report import Table\n" + imports)
    s = s.replace("import ipywidgets as widgets\n", "")  # the slider was its only use
    c["source"] = lines(s)
    data["metadata"].pop("widgets", None)  # the slider's stored widget state
    save(CH2, data)


if __name__ == "__main__":
    chapter2()
