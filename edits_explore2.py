"""Notebook edits for the explorables' cold-reader findings (wt-explore2).
Re-appliable: every edit checks whether it is already done."""
import json

CH = "chapters/"


def load(name):
    with open(CH + name, encoding="utf-8") as f:
        return json.load(f)


def save(name, nb):
    with open(CH + name, "w", encoding="utf-8") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


def src(cell):
    return "".join(cell["source"])


def set_src(cell, text):
    lines = text.split("\n")
    cell["source"] = [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def find(nb, needle):
    hits = [i for i, c in enumerate(nb["cells"]) if needle in src(c)]
    if len(hits) != 1:
        raise SystemExit(f"{needle!r}: {len(hits)} cells")
    return hits[0]


def replace(nb, old, new):
    """Replace ``old`` by ``new`` in the one cell holding it (or none if done)."""
    if any(new in src(c) for c in nb["cells"]) and not any(old in src(c) for c in nb["cells"]):
        return
    i = find(nb, old)
    set_src(nb["cells"][i], src(nb["cells"][i]).replace(old, new))


def markdown(cell_id, text):
    c = {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": []}
    set_src(c, text)
    return c


# chapter 4 (finding 3): three samples copy the part-filled block, one keeps it
nb = load("04_paged_attention.ipynb")
replace(nb, """free, the samples share the prompt's blocks (×4) until each writes its own
token and copies the last one, and the paged cache's memory beside the rows a
reserved cache would hold for the same tokens.""",
        """free; watch the samples share the prompt's blocks (×4): when they write
their first tokens, {glue:text}`cow` of them copy the part-filled last block
and the last writer keeps the original, while the full prompt blocks stay
shared (×4); and compare the paged cache's memory with the rows a reserved
cache would hold for the same tokens.""")
save("04_paged_attention.ipynb", nb)

# chapter 5 (finding 7): point at the row that shows it
nb = load("05_chunked_prefill.ipynb")
replace(nb, """prompt's own first token comes later.""",
        """prompt's own first token comes later (see `req-4`'s row: its prefill chunks
span more steps as the budget shrinks).""")
save("05_chunked_prefill.ipynb", nb)

# chapter 6 (finding 2): the explorable of tight() before the thrashing section
nb = load("06_preemption.ipynb")
cells = nb["cells"]
i = find(nb, "(ch6-thrashing)=")
text = src(cells[i])
if not text.startswith("(ch6-thrashing)="):
    head, tail = text.split("(ch6-thrashing)=", 1)
    set_src(cells[i], head.rstrip("\n") + "\n")
    md = find(nb, "Step through the two runs below (pick the mode)")
    code = find(nb, '"ch6-preemption"')
    assert code == md + 1 and md == i + 1, (i, md, code)
    cells.insert(code + 1, markdown("ch6-thrashing-md", "(ch6-thrashing)=" + tail))
save("06_preemption.ipynb", nb)

# chapter 8 (findings 1 and 6): the figure's axes; what the page recomputes
nb = load("08_serving_under_load.ipynb")
caption = ("Left and centre: p99 TTFT and TPOT against the throughput served in the\n"
           "steady window (an engine at capacity piles up at one x value); right:\n"
           "goodput against the offered rate in the window, dotted line = offered;\n"
           "dashed lines = the SLOs.")
if not any(src(c) == caption for c in nb["cells"]):
    i = find(nb, "plotting.load_curves(")
    nb["cells"].insert(i + 1, markdown("ch8-load-caption", caption))
replace(nb, """and percentile: the page recomputes each engine's percentiles and its goodput
from the requests' latencies""",
        """and percentile: the page recomputes each engine's percentiles, the share of
the window's arrivals that met the SLO, and its goodput from the requests'
latencies""")
save("08_serving_under_load.ipynb", nb)
