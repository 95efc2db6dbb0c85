"""The book's figures: one style, one palette, the same colour for the same idea
in every chapter (prefill, decode, padding; useful vs wasted; each scheduler).
Notebooks call these functions instead of carrying plotting code; each returns
its Figure, which a notebook shows by ending a cell with it."""
from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
from matplotlib.ticker import LogFormatter, MaxNLocator

# One palette for the whole book.
COLORS = {
    "prefill": "#4C72B0",      # blue: prompt tokens being computed
    "decode": "#55A868",       # green: one new token per step
    "pad": "#C44E52",          # red: compute spent on padding (waste)
    "idle": "#EEEEEE",         # light grey: a KV row or block with nothing in it
    "useful": "#55A868",
    "wasted": "#C44E52",
    "static": "#8172B2",       # purple: static batching
    "continuous": "#DD8452",   # orange: iteration-level (continuous) batching
    "paged": "#64B5CD",        # cyan: paged KV cache
    "reserved": "#8C8C8C",     # grey: reserved KV cache
    "compute": "#4C72B0",
    "memory": "#DD8452",
    "waiting": "#DDDDDD",      # grey: queued, not yet started
    "preempted": "#C44E52",    # red: KV memory taken back (recompute)
    "swapped": "#8172B2",      # purple: KV blocks in host memory
    "chunked": "#55A868",      # green: chunked prefill
    "unchunked": "#C44E52",    # red: whole prompts (the stall)
    "fcfs": "#DD8452",         # orange: first come first served (chapter 3's scheduler)
    "priority": "#4C72B0",     # blue: priority scheduling
    "priority + aging": "#64B5CD",
    "fair": "#55A868",         # green: fair share (VTC)
    "off": "#8C8C8C",          # grey: no speculative decoding
    "ngram": "#DA8BC3",        # pink: n-gram (prompt lookup) proposals
    "draft model": "#937860",  # brown: draft-model proposals
    # the phases of a step (profiling.PHASES): the model's forward, and the host around it
    "forward": "#4C72B0",      # blue: the model
    "schedule": "#DD8452",
    "prepare": "#CCB974",
    "sample": "#C44E52",
    "update": "#8172B2",
    "rest": "#8C8C8C",
}
LANE_KINDS = ("idle", "prefill", "decode", "pad")


def use_book_style() -> None:
    """Matplotlib settings shared by every figure of the book."""
    matplotlib.rcParams.update({
        "figure.dpi": 100, "savefig.dpi": 100, "font.size": 10, "axes.titlesize": 11,
        "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
        "grid.alpha": 0.3, "legend.frameon": False, "figure.autolayout": True,
    })


use_book_style()


def _axes(ax, figsize):
    """A new figure (closed to pyplot, so a notebook shows it once, when returned)
    or the figure of the axes given."""
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
        plt.close(fig)
        return fig, ax
    return ax.figure, ax


def _lane_rows(steps):
    """Each lane's row: the rank of its request's KV row or first block among
    those the steps use (the engine records a lane's block before the step's
    update frees anything, so every computed lane has one)."""
    places = sorted({lane.first_block for s in steps for lane in s.lanes if lane.first_block >= 0})
    row = {b: i for i, b in enumerate(places)}
    rows = [[row.get(lane.first_block, -1) for lane in s.lanes] for s in steps]
    return max(len(places), 1), rows


def timeline(trace, ax=None, title: str | None = None, max_steps: int | None = None,
             figsize=(8, 3), x: str = "steps", ylabel: str = "KV row"):
    """Gantt-like view of KV rows or first blocks (y) over steps (x): what each
    computed in each step: prefill, decode, padding, or nothing (idle).
    ``ylabel``: "KV row" (a place in the batch) suits a reserved cache; say
    "first KV block" for a paged one.

    ``x="steps"``: one column per step. ``x="tokens"``: each step as wide as its
    widest lane in tokens, so a padded prefill shows at its width (the longest
    prompt, the left padding first) and a decode step one token wide; every
    cell is then one token row computed, and the red area's share of the
    coloured area is the padding's share, 1 - eta."""
    if x not in ("steps", "tokens"):
        raise ValueError(f"x must be 'steps' or 'tokens', got {x!r}")
    steps = trace.steps[:max_steps] if max_steps else trace.steps
    n_rows, lane_rows = _lane_rows(steps)
    widths = []
    for s, rows in zip(steps, lane_rows):
        per_row: dict[int, int] = {}
        for lane, r in zip(s.lanes, rows):
            per_row[r] = per_row.get(r, 0) + lane.num_tokens
        widths.append(max(per_row.values(), default=1) if x == "tokens" else 1)
    grid = np.zeros((n_rows, max(sum(widths), 1)), dtype=int)
    left = 0
    for s, rows, w in zip(steps, lane_rows, widths):
        if x == "steps":
            for lane, r in zip(s.lanes, rows):
                # a prefill lane that also carries pad tokens shows as prefill
                if r >= 0 and (grid[r, left] == 0 or lane.kind != "pad"):
                    grid[r, left] = LANE_KINDS.index(lane.kind)
        else:
            filled: dict[int, int] = {}
            # left padding first, then the lane's own tokens
            for lane, r in sorted(zip(s.lanes, rows), key=lambda lr: lr[0].kind != "pad"):
                if r >= 0:
                    a = left + filled.get(r, 0)
                    grid[r, a:a + lane.num_tokens] = LANE_KINDS.index(lane.kind)
                    filled[r] = filled.get(r, 0) + lane.num_tokens
        left += w
    fig, ax = _axes(ax, figsize)
    cmap = ListedColormap([COLORS[k] for k in LANE_KINDS])
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=len(LANE_KINDS) - 1,
              extent=(-0.5, grid.shape[1] - 0.5, grid.shape[0] - 0.5, -0.5))
    ax.set_xlabel("engine step" if x == "steps" else
                  "token rows computed (a step as wide as its longest lane)")
    ax.set_ylabel(ylabel)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(False)
    ax.legend(handles=[Patch(facecolor=COLORS[k], edgecolor="grey", label=k) for k in LANE_KINDS],
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title)
    return fig


def cdf(samples: Mapping[str, Sequence[float]], xlabel: str, ax=None, title: str | None = None,
        figsize=(5, 3.2)):
    """Empirical CDFs, one line per label (labels that name a scheduler get its colour)."""
    fig, ax = _axes(ax, figsize)
    for label, vals in samples.items():
        x = np.sort(np.asarray(vals, dtype=float))
        y = np.arange(1, x.size + 1) / x.size
        ax.step(x, y, where="post", label=label, color=COLORS.get(label))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.legend()
    if title:
        ax.set_title(title)
    return fig


def lines(x, ys: Mapping[str, Sequence[float]], xlabel: str, ylabel: str, ax=None,
          title: str | None = None, logx=False, logy=False, markers=True, figsize=(5, 3.2)):
    """Several named series over one x axis."""
    fig, ax = _axes(ax, figsize)
    for label, y in ys.items():
        ax.plot(x, y, marker="o" if markers else None, ms=4, label=label, color=COLORS.get(label))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    if len(ys) > 1:
        ax.legend()
    if title:
        ax.set_title(title)
    return fig


def roofline(gpu, points: Mapping[str, float] | None = None, ax=None, title: str | None = None,
             figsize=(5.5, 3.5)):
    """The roofline of ``gpu`` (attainable FLOP/s against arithmetic intensity),
    with named operations marked at their intensity."""
    fig, ax = _axes(ax, figsize)
    x = np.logspace(-1, 4, 200)
    ax.plot(x, np.minimum(gpu.peak_flops, x * gpu.hbm_bandwidth) / 1e12, color="black", lw=1.5)
    ax.axvline(gpu.ridge_point, color="grey", ls=":", lw=1)
    for label, ai in (points or {}).items():
        y = min(gpu.peak_flops, ai * gpu.hbm_bandwidth) / 1e12
        color = COLORS["memory"] if ai < gpu.ridge_point else COLORS["compute"]
        ax.plot([ai], [y], "o", color=color)
        ax.annotate(label, (ai, y), textcoords="offset points", xytext=(5, -12), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(title or f"Roofline of {gpu.name}")
    return fig


def batch_layout(padded_prompts: Sequence[int], ragged: Sequence[tuple[str, int, int]],
                 padded_labels: Sequence[str] | None = None, step: int | None = None,
                 figsize=(8, 5.6)):
    """Two ways to lay out a batch.

    Top: a padded batch's prefill (static batching): one row per request, prompts
    left-padded to the longest. Middle: a ragged step (iteration-level
    scheduling): the new tokens of every sequence concatenated into one row, no
    padding; this is what the non-attention layers see. Bottom: what attention
    sees for each sequence of the ragged step: its cached tokens plus its new
    ones. ``ragged`` lists (label, cached_tokens, new_tokens); ``padded_labels``
    names the padded rows (default ``req-0``, ``req-1``, ...); ``step`` is the
    ragged step's number, for its title. The two batches need not hold the same
    requests: say in the caption which run and step each comes from.
    """
    labels = list(padded_labels or [f"req-{i}" for i in range(len(padded_prompts))])
    fig, (a, b, c) = plt.subplots(
        3, 1, figsize=figsize, layout="constrained",
        gridspec_kw={"height_ratios": [len(padded_prompts), 1.6, len(ragged)]})
    plt.close(fig)
    P = max(padded_prompts)
    for i, p in enumerate(padded_prompts):
        a.barh(i, P - p, left=0, color=COLORS["pad"], edgecolor="white")
        a.barh(i, p, left=P - p, color=COLORS["prefill"], edgecolor="white")
    a.set_yticks(range(len(padded_prompts)), labels)
    a.invert_yaxis()
    a.set_title("static: the first step of a padded batch, prompts left-padded to the longest")
    a.set_xlabel("token position in the padded row")
    x, total = 0, sum(new for _, _, new in ragged)
    narrow: list[tuple[str, float, int]] = []       # segments too thin for a label inside
    for label, cached, new in ragged:
        kind = "decode" if new == 1 and cached > 0 else "prefill"
        b.barh(0, new, left=x, color=COLORS[kind], edgecolor="white")
        if new >= 0.12 * total:
            b.text(x + new / 2, 0, label, ha="center", va="center", fontsize=8, color="white")
        else:
            narrow.append((label, x + new / 2, new))
        x += new
    if narrow:                                      # one label for the thin ones, above the bar
        names = ", ".join(label for label, _, _ in narrow)
        if all(new == 1 for _, _, new in narrow):
            names += ": one token each"
        centre = float(np.mean([pos for _, pos, _ in narrow]))
        b.annotate(names, (centre, 0.45), xytext=(centre, 1.25), ha="left", va="center",
                   fontsize=8, arrowprops=dict(arrowstyle="-", lw=0.8, color="black"))
    b.set_yticks([])
    b.set_ylim(-0.6, 1.6)
    b.set_xlim(0, max(x, 1))
    where = f"step {step}" if step is not None else "one step"
    b.set_title(f"continuous: {where}, new tokens of every sequence concatenated")
    b.set_xlabel("flat token index (what the MLPs and projections see)")
    for i, (label, cached, new) in enumerate(ragged):
        kind = "decode" if new == 1 and cached > 0 else "prefill"
        c.barh(i, cached, color=COLORS["idle"], edgecolor="grey")
        c.barh(i, new, left=cached, color=COLORS[kind], edgecolor="white")
    c.set_yticks(range(len(ragged)), [label for label, _, _ in ragged])
    c.invert_yaxis()
    c.set_title(f"continuous: {where}, what attention sees for each sequence")
    c.set_xlabel("key position")
    for ax in (a, b, c):
        ax.grid(False)
    fig.legend(handles=[Patch(color=COLORS[k], label=k) for k in ("prefill", "decode", "pad")]
               + [Patch(facecolor=COLORS["idle"], edgecolor="grey", label="cached")],
               loc="outside lower center", ncol=4, fontsize=8)
    return fig


def block_tables(manager, request_ids: Sequence[str], labels: Sequence[str] | None = None,
                 figsize=(8, 4)):
    """PagedAttention's indirection: each sequence's logical blocks (top, in order)
    and where they live in the physical pool (bottom). Colours mark the owner;
    a block shared by several sequences is drawn in grey with a hatch."""
    labels = list(labels or request_ids)
    palette = ["#4C72B0", "#55A868", "#DD8452", "#8172B2", "#64B5CD", "#C44E52", "#937860", "#DA8BC3"]
    owner: dict[int, int] = {}
    for i, rid in enumerate(request_ids):
        for b in manager.block_tables.get(rid, []):
            owner[b] = -1 if b in owner and owner[b] != i else i
    fig, (top, bottom) = plt.subplots(2, 1, figsize=figsize,
                                      gridspec_kw={"height_ratios": [len(request_ids), 2.2]})
    plt.close(fig)

    def face(block):
        o = owner.get(block)
        return ("#BBBBBB", "//") if o == -1 else ((palette[o % len(palette)], None) if o is not None
                                                  else (COLORS["idle"], None))

    for row, rid in enumerate(request_ids):
        for j, b in enumerate(manager.block_tables.get(rid, [])):
            color, hatch = face(b)
            top.add_patch(matplotlib.patches.Rectangle((j, row), 0.95, 0.8, facecolor=color, hatch=hatch,
                                                       edgecolor="white"))
            top.text(j + 0.47, row + 0.4, str(b), ha="center", va="center", fontsize=7, color="black")
    width = max((len(manager.block_tables.get(r, [])) for r in request_ids), default=1)
    top.set_xlim(0, max(width, 1))
    top.set_ylim(len(request_ids), 0)
    top.set_yticks([i + 0.4 for i in range(len(request_ids))], labels)
    top.set_xlabel("logical block (number = physical block id)")
    top.set_title("block tables")
    cols = 32
    rows = -(-manager.num_blocks // cols)
    for b in range(manager.num_blocks):
        color, hatch = face(b)
        bottom.add_patch(matplotlib.patches.Rectangle((b % cols, b // cols), 0.95, 0.9, facecolor=color,
                                                      hatch=hatch, edgecolor="white"))
    bottom.set_xlim(0, cols)
    bottom.set_ylim(rows, 0)
    bottom.set_yticks([])
    bottom.set_xticks([])
    bottom.set_title(f"physical KV pool: {manager.num_blocks} blocks of {manager.block_size} tokens "
                     "(grey hatched: shared, light: free)")
    for ax in (top, bottom):
        ax.grid(False)
        ax.spines[:].set_visible(False)
    return fig


def itl_timeline(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], xlabel: str,
                 ylabel: str, ax=None, title: str | None = None, figsize=(7, 3.2)):
    """Inter-token gaps against time: for each label, (token times, gaps), one
    stem per token (not a line: a gap belongs to one token, and a line between
    two tokens would draw a single stall as a ramp). A prefill that stalls the
    batch shows as one tall stem."""
    fig, ax = _axes(ax, figsize)
    for label, (t, gaps) in series.items():
        color = COLORS.get(label)
        ax.vlines(t, 0, gaps, lw=0.8, color=color, alpha=0.6)
        ax.plot(t, gaps, ls="none", marker="o", ms=2.5, label=label, color=color)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    if title:
        ax.set_title(title)
    return fig


def request_timeline(trace, request_ids: Sequence[str], arrival_steps: Mapping[str, int] | None = None,
                     ax=None, title: str | None = None, figsize=(8, 4)):
    """One row per request, one column per step: waiting, prefill (or recompute),
    decode, and the stretches spent preempted (to recompute) or swapped out."""
    kinds = ["none", "waiting", "prefill", "decode", "preempted", "swapped"]
    row = {rid: i for i, rid in enumerate(request_ids)}
    arrivals = arrival_steps or {rid: 0 for rid in request_ids}
    grid = np.zeros((len(request_ids), max(len(trace), 1)), dtype=int)
    state: dict[str, str | None] = {rid: None for rid in request_ids}
    for j, step in enumerate(trace.steps):
        for rid, a in arrivals.items():
            if a == j and rid in row:
                state[rid] = "waiting"
        for p in step.preempted:                 # taken in this step's scheduling
            if p.request_id in row:
                state[p.request_id] = "preempted" if p.mode == "recompute" else "swapped"
        ran = {lane.request_id: lane.kind for lane in step.lanes
               if lane.request_id in row and lane.kind != "pad"}
        for rid in request_ids:
            if rid in ran:
                grid[row[rid], j] = kinds.index(ran[rid])
                state[rid] = None
            elif state[rid] is not None:
                grid[row[rid], j] = kinds.index(state[rid])
    fig, ax = _axes(ax, figsize)
    colors = ["#FFFFFF", COLORS["waiting"], COLORS["prefill"], COLORS["decode"], COLORS["preempted"],
              COLORS["swapped"]]
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(colors), vmin=0,
              vmax=len(kinds) - 1, extent=(-0.5, grid.shape[1] - 0.5, grid.shape[0] - 0.5, -0.5))
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    ax.grid(False)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in zip(kinds[1:], colors[1:])],
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title)
    return fig


def service_over_time(panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
                      xlabel: str = "time (s)", ylabel: str = "service received (weighted tokens)",
                      title: str | None = None, figsize=(9, 3.2)):
    """One panel per policy, one cumulative curve per client: ``panels[policy][client]
    = (times, cumulative service)``. Panels share their axes."""
    fig, axes = plt.subplots(1, len(panels), figsize=figsize, sharex=True, sharey=True)
    plt.close(fig)
    axes = np.atleast_1d(axes)
    clients = sorted({c for curves in panels.values() for c in curves})
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (policy, curves) in zip(axes, panels.items()):
        for k, client in enumerate(clients):
            if client in curves:
                t, y = curves[client]
                ax.step(t, y, where="post", label=f"client {client}", color=palette[k % len(palette)])
        ax.set_title(policy)
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel(ylabel)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    return fig


def tokens_per_step(counts: Mapping[str, Sequence[int]], ax=None, title: str | None = None,
                    figsize=(5, 3.2)):
    """Speculative decoding: for each proposer, how many request-steps gained
    1, 2, ... tokens (``counts[name][i]`` request-steps gained ``i + 1``)."""
    fig, ax = _axes(ax, figsize)
    width = 0.8 / max(1, len(counts))
    for j, (label, c) in enumerate(counts.items()):
        x = np.arange(1, len(c) + 1) + (j - (len(counts) - 1) / 2) * width
        ax.bar(x, c, width=width, label=label, color=COLORS.get(label))
    n = max(len(c) for c in counts.values())
    ax.set_xticks(np.arange(1, n + 1))
    ax.set_xlabel("tokens gained by a request in one step")
    ax.set_ylabel("request-steps")
    ax.legend()
    if title:
        ax.set_title(title)
    return fig


def _plain_log_labels(axis) -> None:
    """Label a log axis in plain numbers ("20", "40"), not "2x10^1": matplotlib's
    default names the ticks of an axis spanning less than a decade that way."""
    axis.set_major_formatter(LogFormatter())
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def load_curves(curves: Mapping[str, Sequence[Mapping]], slo_ms: Mapping[str, float] | None = None,
                x: str = "request_throughput", stat: str = "p99", title: str | None = None,
                goodput: str = "goodput", offered: str = "rate", figsize=(11, 3.2)):
    """A load sweep in three panels: TTFT and TPOT (at ``stat``) against the
    achieved throughput ``x``, and ``goodput`` against the ``offered`` rate.
    ``curves`` maps a label (a configuration) to its rows, one per rate (the
    JSON rows of ``sweep``; for the steady-state window pass
    ``x="steady_request_throughput", goodput="steady_goodput",
    offered="steady_offered_rate"``). ``slo_ms`` draws the SLO bounds as
    dashed lines."""
    fig, axes = plt.subplots(1, 3, figsize=figsize)
    plt.close(fig)
    xlabel = {"request_throughput": "throughput (requests/s)",
              "steady_request_throughput": "throughput, steady window (requests/s)",
              "output_throughput": "output throughput (tokens/s)"}.get(x, x)
    for label, rows in curves.items():
        rows = sorted(rows, key=lambda r: r[offered])
        color = COLORS.get(label)
        for ax, key in zip(axes[:2], ("ttft", "tpot")):
            ax.plot([r[x] for r in rows], [r[f"{key}_ms_{stat}"] for r in rows], marker="o", ms=3,
                    label=label, color=color)
        if all(goodput in r for r in rows):
            axes[2].plot([r[offered] for r in rows], [r[goodput] for r in rows], marker="o", ms=3,
                         label=label, color=color)
    for ax, key in zip(axes[:2], ("ttft", "tpot")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"{key.upper()} {stat} (ms)")
        ax.set_yscale("log")
        _plain_log_labels(ax.yaxis)
        if slo_ms and key in slo_ms:
            ax.axhline(slo_ms[key], color="k", ls="--", lw=0.8, label="SLO")
    rates = sorted({r[offered] for rows in curves.values() for r in rows})
    axes[2].plot(rates, rates, color="#AAAAAA", ls=":", lw=1, label="offered rate")
    window = " (steady window)" if offered.startswith("steady") else ""
    axes[2].set_xlabel(f"offered rate{window} (requests/s)")
    axes[2].set_ylabel(f"goodput{window} (requests/s)")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def shares(groups: Mapping[str, Mapping[str, float]], xlabel: str = "share of the step", ax=None,
           title: str | None = None, figsize=(6, 2.8)):
    """One horizontal bar per group (``groups[label][part]``: a time, in any unit),
    its parts stacked as shares of the group's total, each labelled with its
    share where it is wide enough."""
    fig, ax = _axes(ax, figsize)
    labels = list(groups)
    parts = list(dict.fromkeys(p for g in groups.values() for p in g))
    left = np.zeros(len(labels))
    for part in parts:
        widths = np.array([groups[g].get(part, 0.0) / sum(groups[g].values()) for g in labels])
        ax.barh(labels, widths, left=left, label=part, color=COLORS.get(part))
        for y, (x0, w) in enumerate(zip(left, widths)):
            if w >= 0.06:
                ax.text(x0 + w / 2, y, f"{w:.0%}", ha="center", va="center", fontsize=8, color="white")
        left += widths
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.grid(False)
    ax.set_xlabel(xlabel)
    ax.legend(ncol=len(parts), loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize=8)
    if title:
        ax.set_title(title)
    return fig
