"""Load a Hugging Face checkpoint directory into our :class:`Transformer`.

A checkpoint on disk is two things: ``config.json`` (the shape of the model) and
one or more ``*.safetensors`` files (named tensors). Loading it is three steps:

1. **Config**: translate the Hugging Face ``config.json`` into a
   :class:`ModelConfig` (:func:`config_from_hf`). Transformers 4.x and 5.x write
   slightly different files (``rope_theta`` vs ``rope_parameters``, ``torch_dtype``
   vs ``dtype``); both are read.
2. **Names**: Hugging Face names its tensors after its own modules
   (``model.layers.0.self_attn.q_proj.weight``); we name ours differently and fuse
   some of them (q, k, v into one ``qkv_proj``; gate and up into one
   ``gate_up_proj``). One small function per family (:func:`llama_weights`,
   :func:`gpt2_weights`) spells the mapping out.
3. **Tensors**: read each tensor straight from the safetensors file (memory-mapped,
   no pickle), check its shape, convert it to the wanted dtype and device, and
   place it into a model built on the ``meta`` device (so no memory is spent on
   random weights that would be overwritten at once).

Only safetensors is read. ``pytorch_model.bin`` and other ``torch.save`` files are
pickles: loading one can run arbitrary code, so they are refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ..core.device import resolve_device, resolve_dtype
from .config import ModelConfig
from .transformer import Transformer

__all__ = ["CheckpointError", "UnsupportedCheckpointError", "load_model", "config_from_hf",
           "read_hf_config", "llama_weights", "gpt2_weights", "SUPPORTED_MODEL_TYPES"]

# model_type in config.json -> our family.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
                         "gpt2": "gpt2"}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: missing or broken files,
    missing or mis-shaped tensors, an unknown architecture."""


class UnsupportedCheckpointError(CheckpointError, NotImplementedError):
    """A well-formed checkpoint that uses a feature our model does not implement
    (RoPE scaling, sliding-window attention, an unusual activation, ...).

    It is both a :class:`CheckpointError` and a :class:`NotImplementedError`."""


# --- step 1: config.json -> ModelConfig ----------------------------------------------

def read_hf_config(path: str | Path) -> dict:
    """The parsed ``config.json`` of checkpoint directory ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory "
                              "(expected a folder with config.json and *.safetensors)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"missing config.json in checkpoint directory {str(path)!r}")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"config.json in {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"config.json in {str(path)!r} must hold a JSON object, got a "
                              f"{type(hf).__name__}")
    return hf


def _first_id(value) -> int | None:
    """Token ids may be written as an int, a list of ints (several EOS tokens) or null."""
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _special_ids(hf: dict, path: Path | None) -> tuple[int | None, int | None]:
    """(bos, eos) ids from config.json, falling back to generation_config.json."""
    bos, eos = _first_id(hf.get("bos_token_id")), _first_id(hf.get("eos_token_id"))
    gen_file = path / "generation_config.json" if path is not None else None
    if (bos is None or eos is None) and gen_file is not None and gen_file.is_file():
        try:
            gen = json.loads(gen_file.read_text())
        except json.JSONDecodeError:
            gen = {}
        bos = bos if bos is not None else _first_id(gen.get("bos_token_id"))
        eos = eos if eos is not None else _first_id(gen.get("eos_token_id"))
    return bos, eos


def _require(hf: dict, key: str):
    if hf.get(key) is None:
        raise CheckpointError(f"config.json has no {key!r} (model_type {hf.get('model_type')!r})")
    return hf[key]


def _require_int(hf: dict, key: str, default=None) -> int:
    """A size from config.json: a positive integer (named in the error if not)."""
    value = hf.get(key, default) if default is not None else _require(hf, key)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"config.json: {key!r} must be a positive integer, got {value!r}")
    return value


def rope_theta_from_hf(hf: dict, default: float = 10000.0) -> float:
    """The RoPE base frequency, from either config layout.

    transformers 4.x: top-level ``rope_theta``, and ``rope_scaling`` (a dict or null)
    for scaled variants. transformers 5.x: ``rope_parameters = {"rope_type": ...,
    "rope_theta": ...}``. Only plain (``"default"``) rotary embeddings are implemented:
    any scaling type (``llama3``, ``yarn``, ``linear``, ``dynamic``, ...) is refused.
    """
    params, scaling = hf.get("rope_parameters"), hf.get("rope_scaling")
    for name, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise CheckpointError(f"config.json {name} should be a dict, got {d!r}")
        if d and all(isinstance(v, dict) for v in d.values()):
            raise UnsupportedCheckpointError(
                f"per-layer-type {name} ({', '.join(d)}) are not supported")
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedCheckpointError(
                f"RoPE scaling type {rope_type!r} (config.json {name}) is not supported; "
                "only plain rotary embeddings (rope_type 'default') are implemented")
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedCheckpointError("partial rotary embeddings (partial_rotary_factor "
                                             f"{d['partial_rotary_factor']}) are not supported")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedCheckpointError("partial rotary embeddings (partial_rotary_factor "
                                         f"{hf['partial_rotary_factor']}) are not supported")
    theta = hf.get("rope_theta")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        theta = params["rope_theta"]        # 5.x layout wins when both are written
    return float(default if theta is None else theta)


def _llama_like_config(hf: dict, name: str, path: Path | None) -> ModelConfig:
    """Llama, Mistral, Qwen2 and Qwen3 share one architecture up to three
    switches: Qwen2 has a bias on q, k, v; Qwen3 normalises each head's q and k
    (RMSNorm) before RoPE; Mistral may use sliding-window attention."""
    model_type = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpointError(
            f"hidden_act {hf['hidden_act']!r} is not supported (the MLP is SwiGLU: 'silu')")
    if hf.get("mlp_bias"):
        raise UnsupportedCheckpointError("mlp_bias=true is not supported (the MLP has no biases)")
    max_position = _require_int(hf, "max_position_embeddings")
    if model_type == "qwen2":
        attention_bias = True                # Qwen2 always has q/k/v bias, no o_proj bias
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    else:
        if hf.get("attention_bias"):         # Llama's and Qwen3's flag also biases o_proj
            raise UnsupportedCheckpointError(
                f"attention_bias=true is not supported for model_type {model_type!r} "
                "(it adds a bias to o_proj as well)")
        attention_bias = False
        # Mistral's default (when the key is absent) is a 4096-token window.
        window = hf.get("sliding_window", 4096) if model_type == "mistral" else None
        if model_type == "qwen3":
            window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is not None and int(window) < max_position:
        raise UnsupportedCheckpointError(
            f"sliding-window attention (sliding_window={window} < max_position_embeddings="
            f"{max_position}) is not supported; every layer here attends to the full context")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedCheckpointError(
            f"layer_types {sorted(set(layer_types))} are not supported (only full_attention)")
    num_heads = _require_int(hf, "num_attention_heads")
    bos, eos = _special_ids(hf, path)
    return ModelConfig(
        family="llama", name=name,
        vocab_size=_require_int(hf, "vocab_size"),
        hidden_size=_require_int(hf, "hidden_size"),
        num_layers=_require_int(hf, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=_require_int(hf, "num_key_value_heads", default=num_heads),
        intermediate_size=_require_int(hf, "intermediate_size"),
        max_position=max_position,
        head_dim=hf.get("head_dim") or None,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_from_hf(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        bos_token_id=bos, eos_token_id=eos,
    )


def _gpt2_config(hf: dict, name: str, path: Path | None) -> ModelConfig:
    """GPT-2 uses its own short key names (n_embd, n_layer, ...)."""
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UnsupportedCheckpointError(
            f"activation_function {act!r} is not supported (the MLP uses tanh-approximated GELU)")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        raise UnsupportedCheckpointError(
            "only the standard 1/sqrt(head_dim) attention scaling is supported "
            "(scale_attn_weights=true, scale_attn_by_inverse_layer_idx=false)")
    hidden = _require_int(hf, "n_embd")
    heads = _require_int(hf, "n_head")
    bos, eos = _special_ids(hf, path)
    return ModelConfig(
        family="gpt2", name=name,
        vocab_size=_require_int(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=_require_int(hf, "n_layer"),
        num_heads=heads, num_kv_heads=heads,
        intermediate_size=_require_int(hf, "n_inner", default=4 * hidden),
        max_position=int(hf.get("n_positions") or _require(hf, "n_ctx")),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        bos_token_id=bos, eos_token_id=eos,
    )


def config_from_hf(hf: dict, name: str = "custom", path: str | Path | None = None) -> ModelConfig:
    """Translate a parsed Hugging Face ``config.json`` into a :class:`ModelConfig`.

    ``path`` (the checkpoint directory), when given, lets missing BOS/EOS ids be
    read from ``generation_config.json``. Raises :class:`CheckpointError` for an
    unknown architecture and :class:`UnsupportedCheckpointError` for a known one
    that uses a feature we do not implement.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = hf.get("architectures") or []
        raise CheckpointError(
            f"unknown architecture: model_type {model_type!r}"
            + (f" ({', '.join(archs)})" if archs else "")
            + f"; supported model types: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
    path = Path(path) if path is not None else None
    if SUPPORTED_MODEL_TYPES[model_type] == "gpt2":
        return _gpt2_config(hf, name, path)
    return _llama_like_config(hf, name, path)


def checkpoint_dtype(hf: dict) -> torch.dtype:
    """The dtype the checkpoint was saved in (5.x ``dtype``, 4.x ``torch_dtype``),
    float32 when neither is written."""
    value = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    try:
        return resolve_dtype(value)
    except ValueError:
        raise CheckpointError(f"config.json names an unknown dtype {value!r}") from None


# --- step 2: Hugging Face names -> our names -----------------------------------------
#
# Each function receives the model config and `ckpt`, which reads one tensor with
# `ckpt.get(hf_name, expected_shape)` (and answers `hf_name in ckpt`). It returns our
# state dict: {our_name: tensor}. Fusing is a torch.cat along the output dimension
# (dim 0 of an nn.Linear weight, which is stored [out_features, in_features]).

def llama_weights(cfg: ModelConfig, ckpt: "SafetensorsCheckpoint") -> dict[str, torch.Tensor]:
    """Llama / Mistral / Qwen2 / Qwen3 names (``model.layers.{i}.self_attn.q_proj.weight``, ...)."""
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    embed = ckpt.get("model.embed_tokens.weight", (cfg.vocab_size, d))
    out = {"embed.weight": embed}
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        out[ours + "attn_norm.weight"] = ckpt.get(hf + "input_layernorm.weight", (d,))
        out[ours + "attn.qkv_proj.weight"] = torch.cat([
            ckpt.get(hf + "self_attn.q_proj.weight", (q_out, d)),
            ckpt.get(hf + "self_attn.k_proj.weight", (kv_out, d)),
            ckpt.get(hf + "self_attn.v_proj.weight", (kv_out, d)),
        ])
        if cfg.attention_bias:               # Qwen2
            out[ours + "attn.qkv_proj.bias"] = torch.cat([
                ckpt.get(hf + "self_attn.q_proj.bias", (q_out,)),
                ckpt.get(hf + "self_attn.k_proj.bias", (kv_out,)),
                ckpt.get(hf + "self_attn.v_proj.bias", (kv_out,)),
            ])
        out[ours + "attn.o_proj.weight"] = ckpt.get(hf + "self_attn.o_proj.weight", (d, q_out))
        if cfg.qk_norm:                      # Qwen3
            out[ours + "attn.q_norm.weight"] = ckpt.get(hf + "self_attn.q_norm.weight", (hd,))
            out[ours + "attn.k_norm.weight"] = ckpt.get(hf + "self_attn.k_norm.weight", (hd,))
        out[ours + "mlp_norm.weight"] = ckpt.get(hf + "post_attention_layernorm.weight", (d,))
        out[ours + "mlp.gate_up_proj.weight"] = torch.cat([
            ckpt.get(hf + "mlp.gate_proj.weight", (inter, d)),
            ckpt.get(hf + "mlp.up_proj.weight", (inter, d)),
        ])
        out[ours + "mlp.down_proj.weight"] = ckpt.get(hf + "mlp.down_proj.weight", (d, inter))
    out["norm.weight"] = ckpt.get("model.norm.weight", (d,))
    out["lm_head.weight"] = embed if cfg.tie_word_embeddings \
        else ckpt.get("lm_head.weight", (cfg.vocab_size, d))
    return out


def gpt2_weights(cfg: ModelConfig, ckpt: "SafetensorsCheckpoint") -> dict[str, torch.Tensor]:
    """GPT-2 names (``transformer.h.{i}.attn.c_attn.weight``, ...).

    GPT-2's layers are ``Conv1D`` modules whose weight is stored ``[in, out]``, the
    transpose of ``nn.Linear``'s ``[out, in]``: every matrix is transposed here.
    ``c_attn`` is already q, k, v fused in that order, like our ``qkv_proj``.
    Older checkpoints (the original ``gpt2`` upload) omit the ``transformer.`` prefix.
    """
    d, inter = cfg.hidden_size, cfg.intermediate_size
    p = "transformer." if "transformer.wte.weight" in ckpt else ""

    def linear(hf_name: str, in_features: int, out_features: int) -> torch.Tensor:
        return ckpt.get(hf_name, (in_features, out_features)).t().contiguous()

    embed = ckpt.get(p + "wte.weight", (cfg.vocab_size, d))
    out = {"embed.weight": embed,
           "pos_embed.weight": ckpt.get(p + "wpe.weight", (cfg.max_position, d))}
    for i in range(cfg.num_layers):
        hf, ours = f"{p}h.{i}.", f"layers.{i}."
        out[ours + "attn_norm.weight"] = ckpt.get(hf + "ln_1.weight", (d,))
        out[ours + "attn_norm.bias"] = ckpt.get(hf + "ln_1.bias", (d,))
        out[ours + "attn.qkv_proj.weight"] = linear(hf + "attn.c_attn.weight", d, 3 * d)
        out[ours + "attn.qkv_proj.bias"] = ckpt.get(hf + "attn.c_attn.bias", (3 * d,))
        out[ours + "attn.o_proj.weight"] = linear(hf + "attn.c_proj.weight", d, d)
        out[ours + "attn.o_proj.bias"] = ckpt.get(hf + "attn.c_proj.bias", (d,))
        out[ours + "mlp_norm.weight"] = ckpt.get(hf + "ln_2.weight", (d,))
        out[ours + "mlp_norm.bias"] = ckpt.get(hf + "ln_2.bias", (d,))
        out[ours + "mlp.fc.weight"] = linear(hf + "mlp.c_fc.weight", d, inter)
        out[ours + "mlp.fc.bias"] = ckpt.get(hf + "mlp.c_fc.bias", (inter,))
        out[ours + "mlp.proj.weight"] = linear(hf + "mlp.c_proj.weight", inter, d)
        out[ours + "mlp.proj.bias"] = ckpt.get(hf + "mlp.c_proj.bias", (d,))
    out["norm.weight"] = ckpt.get(p + "ln_f.weight", (d,))
    out["norm.bias"] = ckpt.get(p + "ln_f.bias", (d,))
    out["lm_head.weight"] = embed if cfg.tie_word_embeddings \
        else ckpt.get("lm_head.weight", (cfg.vocab_size, d))
    return out


WEIGHT_MAPPINGS: dict[str, Callable[[ModelConfig, "SafetensorsCheckpoint"], dict]] = {
    "llama": llama_weights, "gpt2": gpt2_weights,
}


# --- step 3: reading tensors ---------------------------------------------------------

class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory: one ``model.safetensors``, or the shards
    listed by ``model.safetensors.index.json``. Tensors are read one at a time,
    shape-checked, and converted to ``dtype`` on ``device``."""

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device):
        self.path, self.dtype, self.device = path, dtype, device
        self.files = self._weight_map(path)      # tensor name -> file name
        self._handles: dict[str, object] = {}

    @staticmethod
    def _weight_map(path: Path) -> dict[str, str]:
        from safetensors import safe_open

        index = path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{INDEX_FILE} in {str(path)!r} is malformed: {e!r}") from None
            missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
            if missing:
                raise CheckpointError(
                    f"{INDEX_FILE} names shard file(s) missing from {str(path)!r}: {', '.join(missing)}")
            return dict(weight_map)
        candidates = [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() \
            else sorted(path.glob("*.safetensors"))
        if len(candidates) != 1:
            pickles = sorted(f.name for f in path.iterdir()
                             if f.suffix in PICKLE_SUFFIXES or f.name.endswith(".bin.index.json"))
            if not candidates and pickles:
                raise CheckpointError(
                    f"only safetensors checkpoints are supported; {str(path)!r} holds "
                    f"{', '.join(pickles)} (pickle files, which can run arbitrary code when "
                    "loaded, are refused). Convert the weights to model.safetensors first.")
            if not candidates:
                raise CheckpointError(
                    f"no safetensors weights file in {str(path)!r} "
                    f"(expected {SINGLE_FILE} or {INDEX_FILE})")
            raise CheckpointError(
                f"several safetensors files in {str(path)!r} but no {INDEX_FILE} to say which "
                f"to load: {', '.join(f.name for f in candidates)}")
        try:
            with safe_open(candidates[0], framework="pt") as f:
                return {name: candidates[0].name for name in f.keys()}
        except Exception as e:       # safetensors raises its own error type for bad headers
            raise CheckpointError(f"cannot read {candidates[0].name} in {str(path)!r}: {e}") from None

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(self.path / file, framework="pt")
            except Exception as e:
                raise CheckpointError(f"cannot read {file} in {str(self.path)!r}: {e}") from None
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor ``name``, checked to have ``shape``, as ``dtype`` on ``device``."""
        if name not in self.files:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {str(self.path)!r}")
        handle = self._handle(self.files[name])
        try:
            got = tuple(handle.get_slice(name).get_shape())
        except Exception:
            raise CheckpointError(
                f"tensor {name!r} is missing from {self.files[name]} in {str(self.path)!r} "
                "(the index says it is there)") from None
        if got != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {list(got)}, expected {list(shape)}")
        return handle.get_tensor(name).to(device=self.device, dtype=self.dtype)


def load_model(path: str | Path, device: str | torch.device = "auto",
               dtype: str | torch.dtype | None = None) -> Transformer:
    """Load a local Hugging Face checkpoint directory into a :class:`Transformer`.

    ``path`` holds ``config.json`` and ``model.safetensors`` (or shards listed in
    ``model.safetensors.index.json``). Supported ``model_type``: llama, mistral
    (without a sliding window), qwen2 and gpt2. ``dtype=None`` keeps the
    checkpoint's own dtype (float32 when config.json names none). The model's
    ``config.name`` is the directory name. The model is returned in eval mode.

    Raises :class:`CheckpointError` (a ``ValueError``) naming the problem for a bad
    path, missing files, an unknown architecture, a missing or mis-shaped tensor;
    :class:`UnsupportedCheckpointError` (also a ``NotImplementedError``) for RoPE
    scaling and other features not implemented. Never unpickles anything.
    """
    path = Path(path)
    hf = read_hf_config(path)
    cfg = config_from_hf(hf, name=path.resolve().name, path=path)
    dtype = checkpoint_dtype(hf) if dtype is None else resolve_dtype(dtype)
    device = resolve_device(device)
    ckpt = SafetensorsCheckpoint(path, dtype, device)
    state = WEIGHT_MAPPINGS[cfg.family](cfg, ckpt)

    with torch.device("meta"):              # shapes only: no memory, no random init
        model = Transformer(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:             # assign=True replaced both; share them again
        model.lm_head.weight = model.embed.weight
    model.source = str(path)                # where its tokenizer comes from
    return model.eval()
