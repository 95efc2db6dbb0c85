"""This engine beside OpenVINO GenAI's continuous batching on the same checkpoint and workload.

    python benchmarks/vs_openvino.py [--size 125m | --model DIR] [--rounds 3] [--json out.json]

is the same as ``python -m minibatch_engine bench --vs-openvino`` (see
:mod:`minibatch_engine.harness.vs_openvino` for what it runs). Defaults: the tiny
3M-parameter Llama, 64 requests of the ``uniform`` workload (prompts 16-128,
outputs 8-256), batch 64, 2 threads, fp32 weights and KV cache, three
alternating rounds. Needs the ``openvino`` extra.
"""
import sys

from minibatch_engine.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--vs-openvino", "--max-batch", "64", *sys.argv[1:]]))
