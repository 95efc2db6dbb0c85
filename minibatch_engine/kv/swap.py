"""Swap space: a bounded pool of KV blocks in host memory.

When the GPU's block pool runs dry, a preempted request's blocks can be copied
to host memory instead of being thrown away, and copied back into free GPU
blocks when memory returns (vLLM's swap preemption). On CUDA the host pool is
pinned memory, so transfers run at full PCIe speed; this reference
implementation waits for each copy (the device-to-host copy must land before
the GPU blocks are reused). The pool is bounded: when it is full, the scheduler
falls back to recomputation.
"""
from __future__ import annotations

import torch

from .pool import KVPool


class SwapSpace:
    def __init__(self, model_config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device_type: str = "cpu"):
        if num_blocks < 0:
            raise ValueError(f"the swap space needs a non-negative number of blocks, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        host = "meta" if device_type == "meta" else "cpu"
        self.pool = KVPool(model_config.num_layers, max(num_blocks, 1), block_size,
                           model_config.num_kv_heads, model_config.head_dim, dtype, host)
        if device_type == "cuda":
            self.pool.kv = self.pool.kv.pin_memory()
        self.free: list[int] = list(range(num_blocks))
        self.tables: dict[str, list[int]] = {}        # request_id -> host blocks, in order
        self.swapped_out_bytes = 0
        self.swapped_in_bytes = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def can_swap_out(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free)

    def swap_out(self, request_id: str, gpu_pool: KVPool, gpu_blocks: list[int]) -> int:
        """Copy ``gpu_blocks`` to host blocks; returns the bytes copied."""
        host = [self.free.pop(0) for _ in gpu_blocks]
        self.tables[request_id] = host
        if gpu_blocks:
            src = torch.tensor(gpu_blocks, device=gpu_pool.kv.device)
            dst = torch.tensor(host, device=self.pool.kv.device)
            self.pool.kv[:, :, dst] = gpu_pool.kv[:, :, src].to(self.pool.kv.device)
        nbytes = len(gpu_blocks) * gpu_pool.bytes_per_block
        self.swapped_out_bytes += nbytes
        return nbytes

    def swap_in(self, request_id: str, gpu_pool: KVPool, gpu_blocks: list[int]) -> int:
        """Copy a request's host blocks back into ``gpu_blocks``; frees the host blocks."""
        host = self.tables.pop(request_id)
        if len(host) != len(gpu_blocks):
            raise ValueError(f"swap-in of {request_id!r}: {len(host)} host blocks, {len(gpu_blocks)} GPU blocks")
        if host:
            src = torch.tensor(host, device=self.pool.kv.device)
            dst = torch.tensor(gpu_blocks, device=gpu_pool.kv.device)
            gpu_pool.kv[:, :, dst] = self.pool.kv[:, :, src].to(gpu_pool.kv.device)
        self.free.extend(host)
        nbytes = len(host) * gpu_pool.bytes_per_block
        self.swapped_in_bytes += nbytes
        return nbytes

    def discard(self, request_id: str) -> None:
        """Drop a swapped-out request's host blocks (abort)."""
        self.free.extend(self.tables.pop(request_id, []))

    def holds(self, request_id: str) -> bool:
        return request_id in self.tables
