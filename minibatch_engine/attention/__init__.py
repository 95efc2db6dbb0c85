"""Attention over ragged batches: one backend interface, metadata built once per
step by the backend that reads it, and implementations chosen by name
(reference, sdpa, cpp, triton; see :mod:`minibatch_engine.attention.registry`)."""
from .backend import AttentionBackend
from .metadata import BatchMetadata
from .reference import AttentionGroup, AttentionMetadata, ReferenceBackend
from .registry import BACKENDS, get_attention_backend

__all__ = ["AttentionBackend", "get_attention_backend", "BACKENDS", "BatchMetadata",
           "AttentionMetadata", "AttentionGroup", "ReferenceBackend"]
