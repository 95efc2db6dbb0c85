"""A decoder-only transformer that runs on a flat, ragged batch of tokens.

Two families share one skeleton (embed -> N x [norm, attention, norm, MLP] -> norm
-> lm_head):

* ``llama``: RMSNorm, rotary position embedding (RoPE), grouped-query attention,
  SwiGLU MLP, no biases (optional q/k/v bias, as in Qwen2; optional RMSNorm of
  each head's query and key before RoPE, as in Qwen3).
* ``gpt2``: LayerNorm, learned absolute positions, GELU MLP, biases everywhere.

Every layer except attention works on the ``[T, hidden]`` matrix of all new
tokens of the batch, whatever sequence they belong to (Orca's selective
batching): no padding. Attention takes the per-sequence metadata and reads K/V
from the cache through the backend that built the metadata (see
:mod:`minibatch_engine.attention`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import BatchMetadata
from ..core.device import resolve_device, resolve_dtype
from ..core.inputs import check_seed
from . import fused
from .config import ModelConfig, get_preset


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for the given positions (half-rotation layout, as in HF Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                              dtype=torch.float64) / head_dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        bias = cfg.attention_bias or cfg.family == "gpt2"
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=bias)   # fused q, k, v
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.family == "gpt2")
        if cfg.qk_norm:   # Qwen3: each head's q and k normalised over head_dim
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x, rope, meta: BatchMetadata, kv_layer):
        T = x.shape[0]
        qk, v = self.qkv_proj(x).split(
            [(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1)
        qk = qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.cfg.qk_norm:
            H, D = self.num_heads, self.head_dim
            qk = torch.cat([self.q_norm(qk[:, :H].reshape(-1, D)).view(T, H, D),
                            self.k_norm(qk[:, H:].reshape(-1, D)).view(T, -1, D)], dim=1)
        if rope is not None:   # q and k heads rotated together: one set of ops, not two
            qk = fused.apply_rope(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_layer if kv_layer is not None else (None, None)
        out = meta.backend.forward(q, k, v, meta, k_cache, v_cache)   # the backend that built meta
        return self.o_proj(out.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.family == "llama"
        d, i = cfg.hidden_size, cfg.intermediate_size
        if self.gated:
            self.gate_up_proj = nn.Linear(d, 2 * i, bias=False)   # fused gate and up
            self.down_proj = nn.Linear(i, d, bias=False)
        else:
            self.fc = nn.Linear(d, i)
            self.proj = nn.Linear(i, d)

    def forward(self, x):
        if self.gated:
            return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        Norm = (lambda: RMSNorm(cfg.hidden_size, cfg.norm_eps)) if cfg.family == "llama" \
            else (lambda: nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps))
        self.attn_norm, self.attn = Norm(), Attention(cfg)
        self.mlp_norm, self.mlp = Norm(), MLP(cfg)

    def forward(self, x, rope, meta, kv_layer):
        x = x + self.attn(self.attn_norm(x), rope, meta, kv_layer)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """The model. ``forward`` maps flat tokens to the logits of each sequence's last token."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.is_moe:
            raise ValueError(f"{cfg.name} is a mixture of experts: the engine's transformer runs dense shapes; "
                             "price it with the simulator (Engine(None, sim_gpu=..., sim_model=...))")
        self.config = cfg
        self._rope_tables: dict = {}   # (dtype, head_dim, theta, max_position) -> (cos, sin) of every position
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_position, cfg.hidden_size) if cfg.family == "gpt2" else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.family == "llama" \
            else nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin rows of ``positions``. On a CPU they are looked up in a table of all
        ``max_position`` positions, computed once (the same numbers, row by row)."""
        cfg = self.config
        if positions.device.type != "cpu" or positions.numel() == 0 or int(positions.max()) >= cfg.max_position:
            return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
        key = (dtype, cfg.head_dim, cfg.rope_theta, cfg.max_position)   # the config may be replaced
        table = self._rope_tables.get(key)
        if table is None:
            table = self._rope_tables[key] = rope_cos_sin(torch.arange(cfg.max_position), cfg.head_dim,
                                                            cfg.rope_theta, dtype)
        return table[0][positions], table[1][positions]

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata,
                kv_pool=None, all_logits: bool = False) -> torch.Tensor:
        """Run one step.

        input_ids, positions: ``[T]`` flat new tokens of the batch.
        meta: per-sequence lengths and cache slots, built by an attention backend
        (``get_attention_backend(name).build_metadata(...)`` or
        ``AttentionMetadata.build(...)`` for the reference); its ``backend`` runs
        every layer's attention.
        kv_pool: the KV memory (a :class:`~minibatch_engine.kv.KVPool`, or anything
        with ``layer(i) -> (k_slots, v_slots)``), or None for a cache-free forward
        (full recompute).
        Returns logits ``[S, vocab]`` for the last new token of each sequence, or
        ``[T, vocab]`` for every token with ``all_logits=True``.
        """
        x = self.embed(input_ids)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:
            rope = self._rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, meta, None if kv_pool is None else kv_pool.layer(i))
        if not all_logits:
            x = x[meta.logits_indices]
        return self.lm_head(self.norm(x))


def init_random(model: Transformer, seed: int = 0, std: float = 0.02) -> Transformer:
    """Seeded random weights, drawn on the CPU in float32 so every machine gets the
    same numbers, then copied to the model's device and dtype."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name == "norm.weight":
                values = torch.ones(p.shape)
            elif name.endswith("bias"):
                values = torch.zeros(p.shape)
            elif name == "embed.weight":
                values = torch.randn(p.shape, generator=gen)
            elif name == "lm_head.weight":
                values = torch.randn(p.shape, generator=gen) * (1.0 / p.shape[1] ** 0.5) * 4
            else:
                values = torch.randn(p.shape, generator=gen) * std
            p.copy_(values.to(p.dtype))
    return model


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
