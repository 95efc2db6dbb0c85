"""The model: config and presets, the transformer, tokenizers, the checkpoint loader."""
from __future__ import annotations

import torch

from ..device import resolve_device, resolve_dtype
from ..inputs import check_seed
from .config import PRESETS, ModelConfig, get_preset
from .loader import CheckpointError, UnsupportedCheckpointError, load_model
from .reference import full_forward_logits, reference_generate
from .registry import resolve_model, tokenizer_for
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from .transformer import Transformer, init_random


def build_model(config: ModelConfig | str = "tiny", device: str | torch.device = "auto",
                dtype: str | torch.dtype = "float32", seed: int = 0) -> Transformer:
    """A model with seeded random weights (the built-in ``tiny`` preset by default).

    Weights are drawn on the CPU in float32 with ``seed``, so the same preset gives
    the same model on every machine, then moved to ``device`` and ``dtype``.
    """
    cfg = get_preset(config) if isinstance(config, str) else config
    check_seed(seed, "seed (of the model's random weights)")
    model = init_random(Transformer(cfg), seed=seed)
    model = model.to(device=resolve_device(device), dtype=resolve_dtype(dtype)).eval()
    model.source = cfg.name if cfg.name == "tiny" else None   # where its tokenizer comes from
    return model


__all__ = ["ModelConfig", "PRESETS", "get_preset", "Transformer", "build_model",
           "reference_generate", "full_forward_logits", "load_model", "load_tokenizer",
           "ByteTokenizer", "HFTokenizer", "CheckpointError", "UnsupportedCheckpointError",
           "resolve_model", "tokenizer_for"]
