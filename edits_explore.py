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




# --- chapter 3: a step scrubber over the eight-request example -------------
CH3 = "03_continuous_batching.ipynb"
CH3_MD = '''
Drag the step below through the same two runs. The tables say who is in the
batch at step $t$ and what each KV row computes; a static row whose request
has finished computes padding until its batch ends, while an iteration-level
row takes the next request the step after its request finishes.
'''
CH3_CELL = '''
traces = {"static": static_engine.trace, "continuous": cont_engine.trace}
panels = [trace_panel(tr, k, f"{k}, 4 KV rows") for k, tr in traces.items()]
step_scrubber("ch3-steps", {"": panels}, step=8, checks=[totals_check(traces)])
'''


def chapter3():
    data = load(CH3)
    insert_after(CH3, data, 'Table(\n    [\n        ["static", len(static_engine.trace)',
                 [markdown(CH3_MD), code(CH3_CELL)], "ch3-steps")
    add_import(CH3, data, "from minibatch_engine.book.report import Table\n",
               "from minibatch_engine.book.explorables import step_scrubber, totals_check, trace_panel\n")
    save(CH3, data)


def add_import(nb, data, after, line):
    """Add an import line to the set-up cell (the one holding ``after``)."""
    c = data["cells"][find(data, after, nb)]
    s = src(c)
    if line not in s:
        c["source"] = lines(s.replace(after, after + line, 1))


# --- chapter 6: the KV pool running dry, step by step, recompute or swap ---
CH6 = "06_preemption.ipynb"
CH6_MD = '''
Step through the two runs below (pick the mode): each row is a request. Watch
the KV tokens held reach the pool's size, the request that is preempted
(red) or swapped out (purple), and what it costs when it comes back: a
recompute prefill (blue) in one mode, MiB over the host link in the other.
'''
CH6_CELL = '''
tight_runs = {mode: tight(mode, swap_tokens=512) for mode in ("recompute", "swap")}
step_scrubber(
    "ch6-preemption",
    {mode: [preemption_panel(eng, rs)] for mode, (eng, rs) in tight_runs.items()},
    row_label="request", variant_label="preemption mode", step=40,
    checks=[preemption_check(i, eng) for i, (eng, _) in enumerate(tight_runs.values())],
)
'''


def chapter6():
    data = load(CH6)
    insert_after(CH6, data, "workload does not rank them", [markdown(CH6_MD), code(CH6_CELL)],
                 "ch6-preemption")
    add_import(CH6, data, "from minibatch_engine.book.report import Table\n",
               "from minibatch_engine.book.explorables import (\n"
               "    preemption_check,\n    preemption_panel,\n    step_scrubber,\n)\n")
    save(CH6, data)


# --- chapter 5: the token budget, the chunks, and the ITL spike ------------
CH5 = "05_chunked_prefill.ipynb"
CH5_MD = '''
Pick a token budget and drag the step through the 6000-token prompt's
arrival. The table shows which prefill chunk rides with which decodes in the
step; `req-0`'s wait for its token jumps in the step that carries the whole
prompt, and shrinks as the budget cuts the prompt into chunks, while the
prompt's own first token comes later.
'''
CH5_CELL = '''
budgets = {"none (whole prompts)": None, **{f"{b} tokens": b for b in (2048, 512, 256, 128)}}
stalls = {name: stall_run(b) for name, b in budgets.items()}
step_scrubber(
    "ch5-budget",
    {name: [itl_panel(eng, dec[0])] for name, (eng, dec) in stalls.items()},
    row_label="request", variant_label="token budget",
    step=stalls["none (whole prompts)"][0].requests["req-4"].first_scheduled_step,
    checks=[itl_check(i, eng, dec[0]) for i, (eng, dec) in enumerate(stalls.values())],
)
'''


def chapter5():
    data = load(CH5)
    insert_after(CH5, data, 'Table(rows, ["prefill", "ITL p50 (ms)", "ITL max (ms)"]',
                 [markdown(CH5_MD), code(CH5_CELL)], "ch5-budget")
    add_import(CH5, data, "from minibatch_engine.book.report import Table\n",
               "from minibatch_engine.book.explorables import itl_check, itl_panel, step_scrubber\n")
    save(CH5, data)


# --- chapter 7: FCFS, priority and aging on the same arrivals ---------------
CH7 = "07_scheduling_policies.ipynb"
CH7_MD = '''
The same 400 arrivals under each policy, below. Pick a class, then drag the
percentile and the SLO: where FCFS's curve for the interactive class crosses
the SLO, and how far priority moves it, is the head-of-line blocking of this
section; switch to the batch class to see who pays.
'''
CH7_CELL = '''
policies = ("fcfs", "priority", "priority + aging")
policy_latency({name: runs[name] for name in policies}, "mixed-classes", stats=stats)
'''


def chapter7():
    data = load(CH7)
    insert_after(CH7, data, '"TTFT of interactive requests (s)"', [markdown(CH7_MD), code(CH7_CELL)],
                 "ch7-policies")
    add_import(CH7, data, "from minibatch_engine.book.report import Table\n",
               "from minibatch_engine.book.explorables import policy_latency\n")
    save(CH7, data)


# --- chapter 4: the block allocator, step by step ----------------------------
CH4 = "04_paged_attention.ipynb"
CH4_MD = '''
Step through two small runs below: the four requests of the block-table
figure (2-token blocks) and the four samples of one prompt above (16-token
blocks). Watch the tables grow a block at a time wherever the pool has one
free, the samples share the prompt's blocks (×4) until each writes its own
token and copies the last one, and the paged cache's memory beside the rows a
reserved cache would hold for the same tokens.
'''
CH4_CELL = '''
four = [torch.randint(0, 256, (p,)).tolist() for p in (5, 2, 7, 3)]
greedy = SamplingParams(max_tokens=20, ignore_eos=True)
small = dict(max_num_seqs=4, num_kv_blocks=64)
block_explorer({
    "four requests, 2-token blocks": block_run(
        model64, four, greedy, block_size=2, max_model_len=64, **small),
    "4 samples of one prompt, 16-token blocks": block_run(
        model64, [prompt], params, block_size=16, max_model_len=128, **small),
}, step=8)
'''


def chapter4():
    data = load(CH4)
    insert_after(CH4, data, 'print(f"prompt tokens computed: {eng.trace[0].computed_tokens}',
                 [markdown(CH4_MD), code(CH4_CELL)], "ch4-blocks")
    add_import(CH4, data, "from minibatch_engine.book.report import Table\n",
               "from minibatch_engine.book.explorables import block_explorer, block_run\n")
    save(CH4, data)


# --- chapter 8: the sweep, at the SLO and percentile the reader sets ---------
CH8 = "08_serving_under_load.ipynb"
CH8_MD = '''
The same sweep, request by request, below. Drag the arrival rate and watch
each engine's TTFT distribution move against the SLO; then set your own SLO
and percentile: the page recomputes each engine's percentiles and its goodput
from the requests' latencies (at TTFT 500 ms, TPOT 50 ms and p99 it shows the
table's figures), so you can read off, for your SLO, the rate at which each
engine stops delivering.
'''
CH8_CELL = '''
sweep_latency(curves, SLO)  # every request of the sweep above
'''


def chapter8():
    data = load(CH8)
    insert_after(CH8, data, "load_report.steady_rows(curves),  # throughput and goodput",
                 [markdown(CH8_MD), code(CH8_CELL)], "ch8-load")
    add_import(CH8, data, "from minibatch_engine.book.report import Table\n",
               "from minibatch_engine.book.explorables import sweep_latency\n")
    save(CH8, data)


if __name__ == "__main__":
    for edit in (chapter2, chapter3, chapter4, chapter5, chapter6, chapter7, chapter8):
        edit()
