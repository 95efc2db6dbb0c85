"""Swap space: a bounded pool of KV blocks in host memory.

When the GPU's block pool runs dry, a preempted request's blocks can be copied
to host memory instead of being thrown away, and copied back into free GPU
blocks when memory returns (vLLM's swap preemption). The pool is bounded: when
it is full, the scheduler falls back to recomputation.

Two owners, as for the device pool. :class:`SwapSpace` is the scheduler's
bookkeeping: which host blocks are free and which hold whose K/V. The bytes
live in the runner's :class:`HostKVPool`, which carries out the swap copies the
scheduler queued (``BlockCopy("swap_out" | "swap_in", ...)``) before the
step's forward. Two paths, one contract (once :meth:`HostKVPool.swap_out`
returns, the source blocks may be overwritten; what :meth:`HostKVPool.swap_in`
filled can be read by the next kernel):

* **CPU** (and the simulator's ``meta`` device): a plain, synchronous copy.
* **CUDA**: the host pool is *pinned* (page-locked) memory, laid out block by
  block so each block is one contiguous run that the DMA engine copies without
  staging, and the copies are issued on a **side stream**, so the host returns
  at once and goes on scheduling the next step. Correctness comes from stream
  ordering, not from waiting on the host:

  - before a copy starts, the side stream waits for the compute stream (the
    K/V being swapped out has been written; the blocks being swapped into are
    no longer read by an earlier step);
  - after it, an **event** is recorded on the side stream and the compute stream
    waits for it: the next kernel that could write a freed block (swap-out) or
    read a filled one (swap-in) cannot start before the copy has landed;
  - host blocks are only ever touched by copies on that one side stream, so a
    host block freed by a swap-in is not overwritten by a later swap-out until
    the swap-in's read of it is done.

  The GPU still serialises the copy with the next step's kernels (the copy must
  land before those blocks are used); what is saved is the host's wait.
"""
from __future__ import annotations

import torch

from .pool import KVPool


class SwapSpace:
    """``num_blocks`` host blocks: the free list and each swapped-out request's
    host blocks, in order (no memory is taken here)."""

    def __init__(self, num_blocks: int, bytes_per_block: int):
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"the swap space needs a non-negative number of blocks, got {num_blocks!r}")
        self.num_blocks, self.bytes_per_block = num_blocks, bytes_per_block
        self.free_blocks: list[int] = list(range(num_blocks))
        self.tables: dict[str, list[int]] = {}        # request_id -> host blocks, in order
        self.swapped_out_bytes = 0
        self.swapped_in_bytes = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def can_swap_out(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_blocks)

    def swap_out(self, request_id: str, num_blocks: int) -> list[int]:
        """Host blocks for a request's ``num_blocks`` device blocks, in order."""
        host = [self.free_blocks.pop(0) for _ in range(num_blocks)]
        self.tables[request_id] = host
        self.swapped_out_bytes += num_blocks * self.bytes_per_block
        return host

    def swap_in(self, request_id: str) -> list[int]:
        """The request's host blocks, in order, handed back to the free list (the
        runner reads them in this step's copies, before any later swap-out can
        write them)."""
        host = self.tables.pop(request_id)
        self.free_blocks.extend(host)
        self.swapped_in_bytes += len(host) * self.bytes_per_block
        return host

    def discard(self, request_id: str) -> None:
        """Drop a swapped-out request's host blocks (abort)."""
        self.free_blocks.extend(self.tables.pop(request_id, []))

    def holds(self, request_id: str) -> bool:
        return request_id in self.tables


class HostKVPool:
    """The host memory behind a :class:`SwapSpace`, and the copies to and from
    the device pool (the runner's)."""

    def __init__(self, model_config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device_type: str = "cpu", kv_cache_dtype: str = "auto"):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pool = self.host = self.stream = None
        if device_type == "cuda":
            # like the device pool (same dtype, scales and all), one host block contiguous
            like = KVPool(model_config.num_layers, 1, block_size, model_config.num_kv_heads,
                          model_config.head_dim, dtype, "meta", kv_cache_dtype)
            # [host block, layer, K/V, token, kv head(, head dim)] per tensor a block holds
            self.host_tensors = [torch.empty((max(num_blocks, 1),) + t.shape[:2] + t.shape[3:], dtype=t.dtype,
                                             pin_memory=True) for t in like.block_tensors()]
            self.host = self.host_tensors[0]       # the K/V bytes (then the scales, if per token)
            self.stream = torch.cuda.Stream()
            self.last_copy: torch.cuda.Event | None = None
        else:
            self.pool = KVPool(model_config.num_layers, max(num_blocks, 1), block_size,
                               model_config.num_kv_heads, model_config.head_dim, dtype, "cpu", kv_cache_dtype)

    def swap_out(self, gpu_pool: KVPool, gpu_blocks: list[int], host: list[int]) -> None:
        """Copy ``gpu_blocks`` into the host blocks ``host``."""
        if not gpu_blocks:
            return
        if self.stream is not None:
            self._async_out(gpu_pool, gpu_blocks, host)
        else:
            src = torch.tensor(gpu_blocks, device=gpu_pool.kv.device)
            dst = torch.tensor(host, device=self.pool.kv.device)
            for mine, theirs in zip(self.pool.block_tensors(), gpu_pool.block_tensors(), strict=True):
                mine[:, :, dst] = theirs[:, :, src].to(mine.device)

    def swap_in(self, gpu_pool: KVPool, host: list[int], gpu_blocks: list[int]) -> None:
        """Copy the host blocks ``host`` back into ``gpu_blocks``."""
        if len(host) != len(gpu_blocks):
            raise ValueError(f"swap-in: {len(host)} host blocks, {len(gpu_blocks)} GPU blocks")
        if not host:
            return
        if self.stream is not None:
            self._async_in(gpu_pool, gpu_blocks, host)
        else:
            src = torch.tensor(host, device=self.pool.kv.device)
            dst = torch.tensor(gpu_blocks, device=gpu_pool.kv.device)
            for mine, theirs in zip(self.pool.block_tensors(), gpu_pool.block_tensors(), strict=True):
                theirs[:, :, dst] = mine[:, :, src].to(theirs.device)

    # --- the CUDA path: pinned memory, a side stream, events ------------------------
    def _async_out(self, gpu_pool: KVPool, gpu_blocks: list[int], host: list[int]) -> None:
        compute = torch.cuda.current_stream(gpu_pool.kv.device)
        self.stream.wait_stream(compute)            # the K/V to copy has been written
        with torch.cuda.stream(self.stream):
            src = torch.tensor(gpu_blocks, device=gpu_pool.kv.device)
            for host_t, t in zip(self.host_tensors, gpu_pool.block_tensors(), strict=True):
                # [layers, 2, n, ...] -> [n, layers, 2, ...]: each block contiguous
                staged = t.index_select(2, src).movedim(2, 0).contiguous()
                for i, h in enumerate(host):
                    host_t[h].copy_(staged[i], non_blocking=True)
        self._fence(compute)

    def _async_in(self, gpu_pool: KVPool, gpu_blocks: list[int], host: list[int]) -> None:
        compute = torch.cuda.current_stream(gpu_pool.kv.device)
        self.stream.wait_stream(compute)            # earlier steps are done with these blocks
        with torch.cuda.stream(self.stream):
            dev = gpu_pool.kv.device
            dst = torch.tensor(gpu_blocks, device=dev)
            for host_t, t in zip(self.host_tensors, gpu_pool.block_tensors(), strict=True):
                staged = torch.empty((len(host),) + tuple(host_t.shape[1:]), dtype=host_t.dtype, device=dev)
                for i, h in enumerate(host):
                    staged[i].copy_(host_t[h], non_blocking=True)
                # index_copy_ has no float8 kernel: copy the bytes
                t.view(torch.uint8).index_copy_(2, dst, staged.movedim(0, 2).view(torch.uint8))
        self._fence(compute)

    def _fence(self, compute) -> None:
        """The compute stream waits (on the GPU, not the host) for the copies so far."""
        self.last_copy = torch.cuda.Event()
        self.last_copy.record(self.stream)
        compute.wait_event(self.last_copy)

    def synchronize(self) -> None:
        """Block the host until every copy issued so far has landed (tests, shutdown)."""
        if self.stream is not None:
            self.stream.synchronize()
