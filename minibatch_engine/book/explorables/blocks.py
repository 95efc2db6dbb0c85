"""Chapter 4's explorable: the block allocator, step by step. Block tables
fill as sequences grow, blocks are shared after a fork and copied on write,
and the memory held is set beside what a reserved cache (a row of
``max_model_len`` per request) would hold for the same tokens.

:func:`block_run` runs requests through a paged engine and records, after
every step, each request's block table and each held block's fill;
:func:`block_explorer` shows the runs behind a step slider. The browser
counts the blocks held, the tokens in them, the shared blocks and the peak;
the checks compare them with the block manager's own counts
(``num_used_blocks``, ``used_tokens()``, ``num_cow_copies``).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ...config import EngineConfig
from ...core.engine import Engine
from ...sampling.params import SamplingParams
from .base import Explorable


def block_run(model, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
              **config) -> dict:
    """Run ``prompts`` on a paged engine (``config``: :class:`EngineConfig`
    keywords, e.g. ``block_size``, ``num_kv_blocks``, ``max_model_len``) and
    record every step's block tables. Returns one variant for
    :func:`block_explorer`, with the manager's counts for the checks."""
    engine = Engine(model, EngineConfig(scheduler="continuous", kv_layout="paged", **config))
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"block_run: {len(prompts)} prompts but {len(plist)} SamplingParams")
    for p, sp in zip(prompts, plist):
        engine.add_request(list(p), sp)
    m = engine.kv_cache.manager
    names: list[str] = []
    steps, counts = [], []
    cow = m.num_cow_copies
    while engine.has_unfinished():
        engine.step()
        tables = {}
        for rid, table in m.block_tables.items():
            if rid not in names:
                names.append(rid)
            tables[str(names.index(rid))] = list(table)
        held = sorted({b for t in tables.values() for b in t})
        steps.append({"tables": tables, "filled": {str(b): m.blocks[b].num_filled for b in held},
                      "cow": m.num_cow_copies - cow})
        counts.append({"blocks": m.num_used_blocks, "tokens": m.used_tokens()})
        cow = m.num_cow_copies
    return {"requests": names, "steps": steps, "block_size": m.block_size, "num_blocks": m.num_blocks,
            "max_model_len": engine.config.max_model_len, "counts": counts,
            "cow_total": m.num_cow_copies}


def block_explorer(variants: Mapping[str, dict], name: str = "ch4-blocks", step: int = 0,
                   check_steps: Sequence[int] = (0, 3, 8)) -> Explorable:
    """``variants``: ``{label: block_run(...)}``. Checks, per variant, at
    ``check_steps`` (and the last step): blocks held and tokens held equal the
    block manager's; at the last step, the copies on write and the peak."""
    checks = []
    data = []
    for i, (label, v) in enumerate(variants.items()):
        counts = v["counts"]
        last = len(counts) - 1
        for t in sorted({min(t, last) for t in check_steps} | {last}):
            expect = {"blocks": counts[t]["blocks"], "tokens": counts[t]["tokens"]}
            if t == last:
                expect.update(cow=v["cow_total"], peak=max(c["blocks"] for c in counts))
            checks.append({"set": {"variant": i, "step": t}, "expect": expect})
        data.append({"label": label, **{k: v[k] for k in ("requests", "steps", "block_size", "num_blocks",
                                                         "max_model_len")}})
    return Explorable(name, "blocks", {"variants": data, "step": step}, checks,
                      title="The block allocator: drag the step, pick a run")
