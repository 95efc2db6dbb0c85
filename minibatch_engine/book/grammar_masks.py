"""Structured output's token masks, shown and timed (chapter 11).

* :func:`masks_along`: the tokens a grammar allows after each prefix of a
  text, as the matcher computes them step by step;
* :func:`mask_step_costs`: what the masks cost per decode step at several
  batch sizes on this machine. ``B`` constrained requests decode together; at
  each decode step where all ``B`` run, it times filling the ``B`` rows of the
  bitmask (xgrammar, one batched call) and applying them to ``B`` rows of
  logits, and sets them beside the step's forward (the trace's
  ``forward_s``). Medians over the steps; wall clock.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from ..core.engine import Engine
from ..sampling.params import SamplingParams
from ..sampling.structured_output import StructuredOutputManager, StructuredOutputsParams, apply_bitmask, unpack_bitmask


def masks_along(tokenizer, vocab_size: int, grammar: StructuredOutputsParams, text: str,
                cuts: Sequence[int]) -> list[dict]:
    """For each cut (a byte count of ``text``): the prefix, the token ids the
    grammar allows next, and that row of the bitmask (int32 words)."""
    so = StructuredOutputManager(tokenizer, vocab_size, tokenizer.eos_token_id)
    so.add_request("shown", grammar)
    ids, rows, done = tokenizer.encode(text), [], 0
    for cut in sorted(cuts):
        for t in ids[done:cut]:
            if not so.accept("shown", t):
                raise ValueError(f"the grammar refuses {text[:cut]!r}")
        done = cut
        words = so.grammar_bitmask([("shown", "shown")]).bitmask
        allowed = unpack_bitmask(torch.from_numpy(words), vocab_size)[0].nonzero()[:, 0].tolist()
        rows.append({"prefix": tokenizer.decode(ids[:cut]), "allowed": allowed, "words": words[0].tolist()})
    return rows


def mask_step_costs(model, tokenizer, grammar: StructuredOutputsParams, prompt: str,
                    batch_sizes: Sequence[int] = (1, 8, 32, 64), decode_steps: int = 12,
                    **engine_options) -> list[dict]:
    """Per batch size: median milliseconds to fill the step's masks
    (``fill_ms``), to apply them (``apply_ms``), and of the step's forward
    (``forward_ms``), and the masks' share of the forward (``mask_share``).
    The grammar must not end within ``decode_steps`` tokens."""
    ids, out = tokenizer.encode(prompt), []
    for batch in batch_sizes:
        engine = Engine(model, max_num_seqs=batch, tokenizer=tokenizer, **engine_options)
        reqs = [engine.add_request(ids, SamplingParams(max_tokens=decode_steps + 8, temperature=1.0, seed=i,
                                                       structured_outputs=grammar))
                for i in range(batch)]
        so, vocab = engine.scheduler.structured_output, engine.model_config.vocab_size
        logits = torch.randn(batch, vocab, dtype=model.dtype, device=model.device)
        fill, apply, forward = [], [], []
        while engine.has_unfinished() and len(forward) < decode_steps:
            engine.step()
            step = engine.trace[-1]
            if step.prefill_tokens or step.num_scheduled != batch:
                continue                        # decode steps of the whole batch only
            rows = [(r.request_id, r.request_id) for r in reqs]
            t0 = time.perf_counter()
            masks = so.grammar_bitmask(rows)
            t1 = time.perf_counter()
            apply_bitmask(logits, masks.bitmask, range(batch), range(batch))
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
            t2 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            forward.append(step.forward_s)
        if len(forward) < decode_steps:
            raise ValueError(f"batch {batch}: a request ended after {len(forward)} decode steps; "
                             f"use a grammar that needs more than {decode_steps} tokens")
        f, a, fw = (statistics.median(x) * 1e3 for x in (fill, apply, forward))
        out.append({"batch": batch, "fill_ms": f, "apply_ms": a, "forward_ms": fw, "mask_share": (f + a) / fw})
    return out
