"""TorchExecutor: turns a SchedulerOutput into tensors and runs the real model.

Per step it builds, on the host, the flat ``input_ids`` and ``positions`` of
every new token and the attention metadata (lengths, block tables, slot
mapping), copies them to the model's device once, runs one forward over the
whole ragged batch and samples. The only device-to-host copy is the sampled
token ids, which the scheduler needs.
"""
from __future__ import annotations

import time

import torch

from ..attention import AttentionMetadata
from ..model.config import PAD_ID
from ..sampling import sample
from ..scheduler.base import SchedulerOutput
from .base import Executor, ExecutorOutput, needs_fork, sampling_rows


class TorchExecutor(Executor):
    def __init__(self, model, kv_cache, pad_token_id: int | None = None):
        self.model, self.kv_cache = model, kv_cache
        self.device = model.device
        self.pad_token_id = PAD_ID if pad_token_id is None else pad_token_id
        if self.pad_token_id >= model.config.vocab_size:
            self.pad_token_id = 0

    def prepare_inputs(self, sched: SchedulerOutput):
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for s in sched.scheduled:
            r, start = s.request, s.request.num_computed_tokens
            ids += r.all_token_ids[start:start + s.num_tokens]
            positions += range(start, start + s.num_tokens)
            query_lens.append(s.num_tokens)
            seq_lens.append(start + s.num_tokens)
            tables.append(self.kv_cache.block_table(r.request_id))
        null = self.kv_cache.pool.null_block
        for p in sched.padding:
            ids += [self.pad_token_id] * p.num_tokens
            positions += range(p.start_position, p.start_position + p.num_tokens)
            query_lens.append(p.num_tokens)
            seq_lens.append(p.start_position + p.num_tokens)
            n_blocks = -(-(p.start_position + p.num_tokens) // self.kv_cache.block_size)
            tables.append(p.block_table if p.block_table is not None else [null] * n_blocks)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.kv_cache.block_size,
                                       device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        return input_ids, pos, meta

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _fork_sample(self, row_logits, params, k: int):
        gen = self._generator(params.seed + k) if params.seed is not None else None
        return int(sample(row_logits[None], [params], [gen])[0]), gen

    @torch.no_grad()
    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        out = ExecutorOutput()
        if sched.is_empty:
            return out
        input_ids, positions, meta = self.prepare_inputs(sched)
        t0 = time.perf_counter()
        logits = self.model(input_ids, positions, meta, self.kv_cache)
        self._sync()
        t1 = time.perf_counter()
        picks = sampling_rows(sched)
        if picks:
            rows, to_sample = [i for i, _ in picks], [r for _, r in picks]
            for r in to_sample:
                if r.generator is None and r.sampling_params.seed is not None:
                    r.generator = self._generator(r.sampling_params.seed)
            tokens = sample(logits[rows], [r.sampling_params for r in to_sample],
                            [r.generator for r in to_sample]).tolist()
            out.sampled = {r.request_id: t for r, t in zip(to_sample, tokens)}
            for row, r in zip(rows, to_sample):
                if needs_fork(r):   # the other n - 1 samples draw from the same logits
                    out.forks[r.request_id] = [self._fork_sample(logits[row], r.sampling_params, k)
                                               for k in range(1, r.sampling_params.n)]
        t2 = time.perf_counter()
        out.forward_s, out.sample_s = t1 - t0, t2 - t1
        return out
