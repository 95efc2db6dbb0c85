"""Writing one of this engine's Llama-family models as a Hugging Face checkpoint.

The inverse of :func:`minibatch_engine.model.loader.llama_weights`: the fused
``qkv_proj`` and ``gate_up_proj`` matrices are split back into Hugging Face's
``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``, and a
``LlamaConfig`` is filled from the :class:`ModelConfig`. Used to run the very
same weights through ``transformers`` (``benchmarks/vs_transformers.py``).
Needs the optional ``transformers`` package.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .transformer import Transformer


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face Llama names (CPU copies)."""
    cfg = model.config
    if cfg.family != "llama":
        raise ValueError(f"exporting a {cfg.family!r} model is not supported: only the llama family")
    hd = cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    ours = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": ours["embed.weight"], "model.norm.weight": ours["norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ours["lm_head.weight"]
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = ours[src + "attn.qkv_proj.weight"].split([q_out, kv_out, kv_out])
        gate, up = ours[src + "mlp.gate_up_proj.weight"].chunk(2)
        out.update({
            dst + "input_layernorm.weight": ours[src + "attn_norm.weight"],
            dst + "self_attn.q_proj.weight": q.contiguous(),
            dst + "self_attn.k_proj.weight": k.contiguous(),
            dst + "self_attn.v_proj.weight": v.contiguous(),
            dst + "self_attn.o_proj.weight": ours[src + "attn.o_proj.weight"],
            dst + "post_attention_layernorm.weight": ours[src + "mlp_norm.weight"],
            dst + "mlp.gate_proj.weight": gate.contiguous(),
            dst + "mlp.up_proj.weight": up.contiguous(),
            dst + "mlp.down_proj.weight": ours[src + "mlp.down_proj.weight"],
        })
        if cfg.attention_bias:
            qb, kb, vb = ours[src + "attn.qkv_proj.bias"].split([q_out, kv_out, kv_out])
            out.update({dst + "self_attn.q_proj.bias": qb, dst + "self_attn.k_proj.bias": kb,
                        dst + "self_attn.v_proj.bias": vb})
    return out


def save_hf_checkpoint(model: Transformer, path: str | Path):
    """Save ``model`` as a Hugging Face Llama checkpoint (``config.json`` +
    safetensors) in ``path``; returns the ``transformers`` model it built."""
    try:
        import transformers
    except ImportError:
        raise ImportError("saving a Hugging Face checkpoint needs transformers: "
                          "pip install transformers") from None
    cfg = model.config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=None, torch_dtype=str(model.dtype).removeprefix("torch."))
    hf = transformers.LlamaForCausalLM(hf_cfg).to(model.dtype)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"export mismatch: missing {missing}, unexpected {unexpected}")
    hf.save_pretrained(Path(path))
    return hf.eval()
