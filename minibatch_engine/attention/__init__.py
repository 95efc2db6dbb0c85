"""Attention over ragged batches: metadata built once per step, one reference kernel."""
from .metadata import AttentionGroup, AttentionMetadata
from .reference import ragged_attention

__all__ = ["AttentionMetadata", "AttentionGroup", "ragged_attention"]
