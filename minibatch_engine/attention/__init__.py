"""Attention over ragged batches: one backend interface, metadata built once per
step by the backend that reads it, and three implementations (reference, sdpa,
triton; see :mod:`minibatch_engine.attention.backend`)."""
from .backend import BACKENDS, AttentionBackend, get_attention_backend
from .metadata import AttentionGroup, AttentionMetadata, BatchMetadata
from .reference import ReferenceBackend, ragged_attention

__all__ = ["AttentionBackend", "get_attention_backend", "BACKENDS", "BatchMetadata",
           "AttentionMetadata", "AttentionGroup", "ReferenceBackend", "ragged_attention"]
