"""Small trained checkpoints that ship inside the package.

The seeded random ``tiny`` model is identical on every machine, but its text is
noise, and the acceptance rate of speculative decoding on random weights means
nothing. These two byte-level Llama models were trained on the Python standard
library's own source by ``tools/train_tiny.py`` and are committed (bfloat16
safetensors, a few MB) so that every reader gets the same weights without
training:

* ``tiny-py``: the shape of the ``tiny`` preset (4 layers, hidden 256).
* ``tiny-py-draft``: one layer of the same width and vocabulary, the draft model
  for speculative decoding with ``tiny-py``.

Each folder is a Hugging Face checkpoint (``config.json``, ``model.safetensors``,
a ``tokenizer_config.json`` that names the byte tokenizer, a ``README.md`` with
the corpus, training time and losses)::

    from minibatch_engine.model import load_model, load_tokenizer
    from minibatch_engine.model.trained import trained_model_path

    path = trained_model_path("tiny-py")
    model, tokenizer = load_model(path), load_tokenizer(path)
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["TRAINED_MODELS", "WEIGHTS_DIR", "trained_model_path"]

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"

#: name -> one line saying what it is
TRAINED_MODELS: dict[str, str] = {
    "tiny-py": "byte-level Llama, the tiny preset's shape (4 layers), trained on Python stdlib source",
    "tiny-py-draft": "one-layer sibling of tiny-py (same vocabulary), its speculative-decoding draft",
}


def trained_model_path(name: str) -> Path:
    """The checkpoint folder of the trained model ``name`` (``"tiny-py"``, ``"tiny-py-draft"``)."""
    if name not in TRAINED_MODELS:
        raise ValueError(f"unknown trained model {name!r}; known: {', '.join(sorted(TRAINED_MODELS))}")
    path = WEIGHTS_DIR / name
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"trained model {name!r} is missing its files in {str(path)!r}: the package was "
            "installed without its package data (reinstall it), or the weights were never "
            "written (run `python tools/train_tiny.py` from the repository root)")
    return path
