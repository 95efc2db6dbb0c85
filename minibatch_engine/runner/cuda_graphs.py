"""CUDA graphs for decode-only steps: one launch replays a whole forward.

A decode step of a small model is a few hundred tiny kernels (per layer: norm,
QKV projection, RoPE, cache write, attention, output projection, norm, MLP). On
a GPU each launch costs microseconds of CPU time in Python, PyTorch's
dispatcher and the driver, while the kernel itself may run for less: the GPU
idles between launches and decode becomes *launch-bound*. A CUDA graph records
the kernels of one forward once and replays them with a single launch
(``torch.cuda.CUDAGraph``; vLLM and TensorRT-LLM do the same for decode).

A graph replays the *same* kernels on the *same* addresses with the *same*
shapes, so everything a step changes must live in static buffers that the step
overwrites before ``replay()``:

* **Bucketed batch sizes.** A decode step of ``n`` sequences runs the graph of
  the smallest bucket ``B >= n`` (1, 2, 4, 8, then multiples of 8, up to
  ``max_num_seqs``); rows ``n..B-1`` are padding. Graphs are captured lazily,
  the first time a bucket is needed.
* **Static metadata.** The ``"triton"`` backend's metadata is plain tensors
  (lengths, offsets, block tables, slot mapping) whose shapes depend only on
  ``B`` and on the block-table width, fixed here at
  ``ceil(max_model_len / block_size)``. The kernel reads each sequence's length
  from device memory and loops over its blocks on the GPU, so a longer context
  needs no new graph. Padding rows have length 1, a block table of the pool's
  *null block* and write their K/V into that block, which no request owns.
* **What is not captured.** Prefills and mixed steps (their token count and
  per-sequence query lengths change every step, and large ones amortise their
  launches; vLLM V1 captures piecewise graphs for them, attention left eager,
  up to a token limit: not done here),
  and the ``"sdpa"``/``"reference"`` backends, whose metadata is a Python-level
  plan of buckets and padded groups that changes from step to step: with them
  every step runs eagerly.

Each graph has its own memory pool: lazily captured graphs never share
intermediate buffers, at the cost of some memory. Sampling runs after the
replay, on the first ``n`` rows of the static logits.
"""
from __future__ import annotations

import torch

from ..attention.metadata import BatchMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, 16, 24, ... (multiples of 8), the last one
    ``>= max_num_seqs``."""
    sizes, b = [], 1
    while not sizes or sizes[-1] < max_num_seqs:
        sizes.append(b)
        b = b * 2 if b < 8 else b + 8
    return sizes


class DecodeGraphs:
    """Captures and replays one CUDA graph per decode batch-size bucket."""

    def __init__(self, model, kv_pool, attention, max_num_seqs: int, max_model_len: int, pad_token_id: int):
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on CUDA")
        if attention.name != "triton":
            raise ValueError(f'CUDA graphs need the "triton" attention backend (static metadata), '
                             f'not {attention.name!r}')
        self.model, self.kv_pool, self.attention = model, kv_pool, attention
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.block_size = kv_pool.block_size
        self.width = -(-max_model_len // self.block_size)
        self.null = kv_pool.null_block
        self.pad_token_id = pad_token_id
        B, dev, long = self.sizes[-1], model.device, torch.long
        # One set of static buffers, sized for the largest bucket; bucket B uses the first B rows.
        self.input_ids = torch.zeros(B, dtype=long, device=dev)
        self.positions = torch.zeros(B, dtype=long, device=dev)
        self.seq_lens = torch.ones(B, dtype=long, device=dev)
        self.slot_mapping = torch.full((B,), self.null * self.block_size, dtype=long, device=dev)
        self.block_tables = torch.full((B, self.width), self.null, dtype=long, device=dev)
        self.query_lens = torch.ones(B, dtype=long, device=dev)
        self.query_start_loc = torch.arange(B + 1, dtype=long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}   # B -> (graph, logits)
        self.replays = 0

    def bucket(self, n: int) -> int | None:
        """The smallest captured size that holds ``n`` sequences (None: too many)."""
        return next((b for b in self.sizes if b >= n), None)

    def can_run(self, sched) -> bool:
        """A decode-only step (one new token per request, no padding entries) that fits a bucket."""
        return (not sched.padding and 0 < len(sched.scheduled) <= self.sizes[-1]
                and all(s.num_tokens == 1 for s in sched.scheduled))

    def _metadata(self, B: int) -> BatchMetadata:
        return BatchMetadata(
            query_lens=self.query_lens[:B], seq_lens=self.seq_lens[:B],
            query_start_loc=self.query_start_loc[:B + 1], slot_mapping=self.slot_mapping[:B],
            block_tables=self.block_tables[:B], block_size=self.block_size,
            logits_indices=self.query_start_loc[:B], max_query_len=1,
            max_seq_len=self.width * self.block_size, backend=self.attention)

    def _fill(self, B: int, ids: list[int], seq_lens: list[int], tables: list[list[int]]) -> None:
        """Write the step into the static buffers; rows past ``len(ids)`` are padding."""
        n, bs, null, W = len(ids), self.block_size, self.null, self.width
        pos = [s - 1 for s in seq_lens]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
        pad = B - n
        rows = [t + [null] * (W - len(t)) for t in tables] + [[null] * W] * pad
        host = torch.tensor([ids + [self.pad_token_id] * pad, pos + [0] * pad,
                             seq_lens + [1] * pad, slots + [null * bs] * pad], dtype=torch.long)
        self.input_ids[:B].copy_(host[0], non_blocking=True)
        self.positions[:B].copy_(host[1], non_blocking=True)
        self.seq_lens[:B].copy_(host[2], non_blocking=True)
        self.slot_mapping[:B].copy_(host[3], non_blocking=True)
        self.block_tables[:B].copy_(torch.tensor(rows, dtype=torch.long), non_blocking=True)

    @torch.no_grad()
    def _capture(self, B: int):
        self._fill(B, [], [], [])        # all padding: warm-up and capture touch only the null block
        meta = self._metadata(B)
        args = (self.input_ids[:B], self.positions[:B], meta, self.kv_pool)
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):    # warm up off the capture: Triton compiles, cuBLAS picks kernels
            for _ in range(2):
                self.model(*args)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.model(*args)
        return graph, logits

    def run(self, ids: list[int], seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode step of ``n = len(ids)`` sequences."""
        B = self.bucket(len(ids))
        if B not in self.graphs:
            self.graphs[B] = self._capture(B)
        graph, logits = self.graphs[B]
        self._fill(B, ids, seq_lens, tables)
        graph.replay()
        self.replays += 1
        return logits[:len(ids)]
