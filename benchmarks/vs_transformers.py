"""This engine beside Hugging Face transformers on the same weights and workload.

    python benchmarks/vs_transformers.py [--rounds 3] [--json out.json]

is the same as ``python -m minibatch_engine bench --vs-transformers`` (see
:mod:`minibatch_engine.harness.vs_transformers` for what it runs). Defaults: the tiny
Llama shape, 64 requests of the ``uniform`` workload (prompts 16-128, outputs
8-256), batch 64, 2 threads, the default attention backend (``auto``: the C++
kernel on a CPU where it builds). Needs ``transformers``.
"""
import sys

from minibatch_engine.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--vs-transformers", "--max-batch", "64", *sys.argv[1:]]))
