"""Draw the introduction's figure, book/intro_bubbles.png: the decode bubbles
of static batching, and the same requests scheduled at every step.

Run from the repository root. It needs only the package: the engine runs the
two schedules without a model (the simulator stands in for it), and the
figure counts steps:

    python book/make_intro_figure.py

The eight requests are chapters 2 and 3's example; the figure is theirs, side
by side on one step axis.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from minibatch_engine import Engine, EngineConfig, SamplingParams
from minibatch_engine.book import plotting

EXAMPLE = [(12, 30), (40, 8), (8, 60), (25, 15), (30, 45), (10, 5), (16, 12), (6, 20)]
OUT = Path(__file__).resolve().parent / "intro_bubbles.png"


def trace_of(scheduler: str):
    engine = Engine(None, EngineConfig(
        scheduler=scheduler, max_num_seqs=4, max_model_len=1024, kv_layout="reserved",
        max_num_batched_tokens=None, sim_gpu="H100-SXM", sim_model="llama-3-8b"))
    rng = np.random.default_rng(0)
    for p, g in EXAMPLE:
        engine.add_request(rng.integers(0, 256, p).tolist(),
                           SamplingParams(max_tokens=g, ignore_eos=True))
    engine.run()
    return engine.trace


def main() -> None:
    fig, axes = plt.subplots(2, 1, figsize=(8, 4.4), sharex=True, layout="constrained")
    steps = 0
    for ax, (name, title) in zip(axes, (
            ("static", "static batching: a finished request's row computes padding (red)"),
            ("continuous", "iteration-level scheduling: a freed row is refilled the next step"))):
        trace = trace_of(name)
        plotting.timeline(trace, ax=ax, title=f"{title}, {len(trace)} steps")
        steps = max(steps, len(trace))
    axes[0].set_xlim(-0.5, steps - 0.5)     # one step axis: the static run is longer
    axes[0].set_xlabel("")
    fig.savefig(OUT, dpi=100, metadata={"Software": None})
    print(f"wrote {OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT}")


if __name__ == "__main__":
    main()
