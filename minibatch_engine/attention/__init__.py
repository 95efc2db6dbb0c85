"""Attention over ragged batches: metadata built once per step, one reference kernel."""
from .metadata import AttentionMetadata
from .reference import ragged_attention

__all__ = ["AttentionMetadata", "ragged_attention"]
