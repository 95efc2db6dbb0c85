"""The model: config and presets, the transformer, tokenizers, the checkpoint loader."""
from __future__ import annotations

from .config import PRESETS, ModelConfig, get_preset
from .loader import CheckpointError, UnsupportedCheckpointError, load_model
from .reference import full_forward_logits, reference_generate
from .registry import resolve_model, tokenizer_for
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from .transformer import Transformer, build_model, init_random

__all__ = ["ModelConfig", "PRESETS", "get_preset", "Transformer", "build_model",
           "reference_generate", "full_forward_logits", "load_model", "load_tokenizer",
           "ByteTokenizer", "HFTokenizer", "CheckpointError", "UnsupportedCheckpointError",
           "resolve_model", "tokenizer_for"]
