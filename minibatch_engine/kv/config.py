"""The KV cache's knobs, validated where they are used (composed by
``EngineConfig``, which keeps one flat keyword interface for users)."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.checks import check_bool, check_choice, check_int, check_number
from .quant import KV_CACHE_DTYPES

KV_LAYOUTS = ("paged", "reserved")        # and "auto": paged, or reserved for static batching


@dataclass(frozen=True)
class CacheConfig:
    """How KV memory is laid out and how much there is (see
    :class:`~minibatch_engine.config.EngineConfig` for each field)."""
    kv_layout: str = "auto"
    block_size: int = 16
    kv_budget_bytes: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    swap_space_bytes: int = 0
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        check_choice("kv_layout", self.kv_layout, KV_LAYOUTS + ("auto",))
        check_int("block_size", self.block_size, 1)
        check_int("kv_budget_bytes", self.kv_budget_bytes, 1, optional=True)
        check_int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        check_int("swap_space_bytes", self.swap_space_bytes, 0)
        check_number("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_open=True)
        check_number("watermark", self.watermark, 0.0, 1.0, high_open=True)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
