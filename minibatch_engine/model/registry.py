"""Resolving a model argument, written once for every front door.

``model`` may be ``"tiny"`` (the built-in seeded model), the name of a small
trained model shipped with the package (``"tiny-py"``, ``"tiny-py-draft"``), a
directory holding a Hugging Face checkpoint, or an already built
:class:`Transformer`. The
tokenizer comes from where the model came from; a checkpoint without one runs
token-id prompts only (vLLM's ``skip_tokenizer_init``).
"""
from __future__ import annotations

from pathlib import Path

from .config import PRESETS
from .loader import CheckpointError, load_model
from .tokenizer import TOKENIZER_KEY, ByteTokenizer, HFTokenizer, load_tokenizer
from .trained import TRAINED_MODELS, trained_model_path
from .transformer import Transformer, build_model

BUILT_IN = ("tiny",)


def tokenizer_for(source) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer that belongs with a model's source (a preset name or a
    checkpoint directory); None when the source has none."""
    if source is None:
        return None
    if isinstance(source, str) and source.lower() in BUILT_IN:
        return ByteTokenizer()
    path = Path(source)
    has_byte_marker = (path / "tokenizer_config.json").is_file() and \
        TOKENIZER_KEY in (path / "tokenizer_config.json").read_text()
    if has_byte_marker or (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    return None


def resolve_model(model="tiny", device="auto", dtype="float32", seed: int = 0,
                  quantization: str | None = None) -> Transformer:
    """Build or load the model named by ``model``; the result remembers its
    source as ``model.source`` (for :func:`tokenizer_for`). ``quantization``
    (``"int8"``, ``"int8_weight_only"``; :mod:`.quantization`) quantizes its
    projections, a given :class:`Transformer` being copied first."""
    if quantization is not None:
        from .quantization import quantize_weights
        if isinstance(model, Transformer):
            import copy
            model = copy.deepcopy(model)
        return quantize_weights(resolve_model(model, device, dtype, seed), quantization)
    if isinstance(model, Transformer):
        return model
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be 'tiny', a checkpoint directory or a Transformer, "
                        f"got {type(model).__name__}")
    if isinstance(model, str) and model.lower() in BUILT_IN:
        return build_model(model.lower(), device=device, dtype=dtype, seed=seed)
    if isinstance(model, str) and model.lower() in TRAINED_MODELS:
        model = trained_model_path(model.lower())
    path = Path(model)
    if isinstance(model, str) and model.lower() in PRESETS and not path.exists():
        raise ValueError(f"{model!r} is a shape-only preset without weights: use it with the simulator "
                         f"(sim_model={model!r}, or the `simulate` command), or pass a checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"model {str(model)!r} is not 'tiny', a trained model "
                              f"({', '.join(TRAINED_MODELS)}) or a checkpoint directory")
    return load_model(path, device=device, dtype=dtype)
