"""Model configuration and the one place where presets are defined.

A :class:`ModelConfig` describes a decoder-only transformer of either family the
engine runs: ``"llama"`` (RMSNorm, rotary positions, grouped-query attention,
SwiGLU) or ``"gpt2"`` (LayerNorm, learned positions, GELU). The same dataclass
also feeds the KV-cache memory formula and the roofline simulator, so the shapes
of published models (Llama-2-7B, Llama-3-8B, ...) live here too.

A mixture-of-experts (MoE) shape (Shazeer et al. 2017; Mixtral, DeepSeek-V3,
Qwen3-MoE) replaces the MLP of its layers, after the first
``first_k_dense_layers``, by ``num_experts`` routed experts of width
``moe_intermediate_size`` (a router sends each token to ``num_experts_per_tok``
of them) plus ``num_shared_experts`` that every token runs through. Its total
parameters (:attr:`ModelConfig.total_parameters`) set the memory it needs; its
active parameters (:attr:`ModelConfig.active_parameters`), the FLOPs per token.
The simulator prices MoE shapes (:mod:`minibatch_engine.sim.moe`); the engine's
own transformer runs dense shapes only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

FAMILIES = ("llama", "gpt2")


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_shared_experts",
              "first_k_dense_layers")


@dataclass(frozen=True, repr=False)
class ModelConfig:
    """Shape of a decoder-only transformer (its repr names the expert fields
    only for a mixture of experts)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position: int
    head_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False          # Qwen3: RMSNorm over each head's q and k before RoPE
    eos_token_id: int | None = None
    bos_token_id: int | None = None
    name: str = "custom"
    # mixture of experts (0 routed experts: a dense model)
    num_experts: int = 0              # routed experts per MoE layer
    num_experts_per_tok: int = 0      # top-k: experts each token is routed to
    moe_intermediate_size: int = 0    # one expert's MLP width
    num_shared_experts: int = 0       # experts every token runs through (DeepSeek, Qwen2-MoE)
    first_k_dense_layers: int = 0     # the first layers keep a dense MLP (DeepSeek's first_k_dense_replace)

    def __repr__(self) -> str:
        shown = [f for f in self.__dataclass_fields__ if self.num_experts or f not in MOE_FIELDS]
        return f"ModelConfig({', '.join(f'{f}={getattr(self, f)!r}' for f in shown)})"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                      "num_kv_heads", "intermediate_size", "max_position"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError("hidden_size must be a multiple of num_heads when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        self._check_experts()

    def _check_experts(self) -> None:
        moe = ("num_experts_per_tok", "moe_intermediate_size", "num_shared_experts", "first_k_dense_layers")
        for field in ("num_experts", *moe):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{field} must be a non-negative integer, got {v!r}")
        if not self.num_experts:
            set_ = [f for f in moe if getattr(self, f)]
            if set_:
                raise ValueError(f"{', '.join(set_)} describe experts: set num_experts too (0 = a dense model)")
            return
        if self.family != "llama":
            raise ValueError(f"experts need the llama family (a gated MLP), got {self.family!r}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and num_experts ({self.num_experts}), "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError("moe_intermediate_size must be positive for a mixture of experts")
        if self.first_k_dense_layers >= self.num_layers:
            raise ValueError(f"first_k_dense_layers ({self.first_k_dense_layers}) must be fewer than "
                             f"num_layers ({self.num_layers})")

    # --- mixture of experts ---------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        """Whether some layers route tokens to experts."""
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return self.num_layers - self.first_k_dense_layers if self.is_moe else 0

    @property
    def expert_parameters(self) -> int:
        """Parameters of one expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def mlp_parameters(self, routed_experts: int | None = None) -> int:
        """The MLP projections' parameters, all layers: dense layers at
        ``intermediate_size``; MoE layers with ``routed_experts`` of their routed
        experts (default all of them) and every shared expert. The router is
        not a projection (see :meth:`router_parameters`)."""
        d = self.hidden_size
        dense = (3 if self.family == "llama" else 2) * d * self.intermediate_size
        if not self.is_moe:
            return self.num_layers * dense
        routed = self.num_experts if routed_experts is None else routed_experts
        return (self.first_k_dense_layers * dense
                + self.num_moe_layers * (routed + self.num_shared_experts) * self.expert_parameters)

    def router_parameters(self) -> int:
        """The routers' weights, all MoE layers (``hidden x experts`` each)."""
        return self.num_moe_layers * self.hidden_size * self.num_experts

    @property
    def total_parameters(self) -> int:
        """Every parameter, all experts included: what the weights' memory holds."""
        return self.num_parameters()

    @property
    def active_parameters(self) -> int:
        """Parameters one token runs through: the routed experts counted
        ``num_experts_per_tok`` times (equal to the total for a dense model)."""
        return self.num_parameters(routed_experts=self.num_experts_per_tok if self.is_moe else None)

    # --- sizes the book keeps asking for -------------------------------------------
    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes of K and V one token occupies in the cache, all layers together:
        2 x layers x kv_heads x head_dim x bytes_per_element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def num_parameters(self, include_embeddings: bool = True, routed_experts: int | None = None) -> int:
        """Parameter count from the shapes alone (matches the module's own count);
        for a mixture of experts, with ``routed_experts`` routed experts per MoE
        layer (default all: the total)."""
        d, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = d * (q + 2 * kv) + q * d
        if self.family == "llama":
            mlp = 0
            norms = 2 * d
            bias = (q + 2 * kv) if self.attention_bias else 0
            norms += 2 * hd if self.qk_norm else 0
        else:  # gpt2: biases everywhere, LayerNorm has weight and bias
            mlp = 2 * d * self.intermediate_size + self.intermediate_size + d
            norms = 4 * d
            bias = (q + 2 * kv) + d
        per_layer = attn + mlp + norms + bias
        total = self.num_layers * per_layer + (2 * d if self.family == "gpt2" else d)
        if self.family == "llama":
            total += self.mlp_parameters(routed_experts) + self.router_parameters()
        if include_embeddings:
            total += self.vocab_size * d
            if not self.tie_word_embeddings:
                total += self.vocab_size * d
            if self.family == "gpt2":
                total += self.max_position * d
        return total

    def with_(self, **changes) -> "ModelConfig":
        return replace(self, **changes)


# --- presets -------------------------------------------------------------------------
# The byte-level vocabulary of the built-in model: 256 byte values, then specials.
BYTE_VOCAB = 256
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258

TINY = ModelConfig(
    family="llama", name="tiny", vocab_size=260, hidden_size=256, num_layers=4,
    num_heads=4, num_kv_heads=2, intermediate_size=688, max_position=2048,
    bos_token_id=BOS_ID, eos_token_id=EOS_ID,
)

# Shapes of published checkpoints, copied from their config.json files, used by the
# memory formula and the simulator (no weights: these models are never instantiated).
LLAMA_2_7B = ModelConfig(
    family="llama", name="llama-2-7b", vocab_size=32000, hidden_size=4096, num_layers=32,
    num_heads=32, num_kv_heads=32, intermediate_size=11008, max_position=4096)
LLAMA_2_13B = ModelConfig(
    family="llama", name="llama-2-13b", vocab_size=32000, hidden_size=5120, num_layers=40,
    num_heads=40, num_kv_heads=40, intermediate_size=13824, max_position=4096)
LLAMA_3_8B = ModelConfig(
    family="llama", name="llama-3-8b", vocab_size=128256, hidden_size=4096, num_layers=32,
    num_heads=32, num_kv_heads=8, intermediate_size=14336, max_position=8192,
    rope_theta=500000.0)
LLAMA_3_70B = ModelConfig(
    family="llama", name="llama-3-70b", vocab_size=128256, hidden_size=8192, num_layers=80,
    num_heads=64, num_kv_heads=8, intermediate_size=28672, max_position=8192,
    rope_theta=500000.0)
# meta-llama/Llama-3.1-405B's config.json (Hugging Face, July 2024): 126 layers, 16384 wide, 128 query
# heads over 8 KV heads, SwiGLU 53248 wide, 128K context (its "llama3" RoPE scaling is not modelled:
# the simulator prices shapes only).
LLAMA_3_1_405B = ModelConfig(
    family="llama", name="llama-3.1-405b", vocab_size=128256, hidden_size=16384, num_layers=126,
    num_heads=128, num_kv_heads=8, intermediate_size=53248, max_position=131072,
    rope_theta=500000.0)
# Llama 3.2 1B shares Llama 3's tokenizer: the usual draft for an 8B or 70B target.
LLAMA_3_2_1B = ModelConfig(
    family="llama", name="llama-3.2-1b", vocab_size=128256, hidden_size=2048, num_layers=16,
    num_heads=32, num_kv_heads=8, intermediate_size=8192, max_position=8192,
    rope_theta=500000.0, tie_word_embeddings=True)
GPT2_SMALL = ModelConfig(
    family="gpt2", name="gpt2", vocab_size=50257, hidden_size=768, num_layers=12,
    num_heads=12, num_kv_heads=12, intermediate_size=3072, max_position=1024,
    tie_word_embeddings=True)


# Mixtures of experts (simulator only). Each comment gives the config.json values copied
# and the parameter counts the model card publishes (tests/engine/test_sim_moe.py checks them).
MIXTRAL_8X7B = ModelConfig(
    # mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, intermediate_size 14336,
    # num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8, num_local_experts 8,
    # num_experts_per_tok 2, vocab_size 32000, max_position_embeddings 32768, rope_theta 1e6;
    # Mistral AI, "Mixtral of experts" (2023-12-11): 46.7B total, 12.9B active per token
    family="llama", name="mixtral-8x7b", vocab_size=32000, hidden_size=4096, num_layers=32,
    num_heads=32, num_kv_heads=8, intermediate_size=14336, max_position=32768, rope_theta=1e6,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336)
QWEN3_30B_A3B = ModelConfig(
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
    # num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8,
    # moe_intermediate_size 768, intermediate_size 6144 (unused: no dense layer), vocab_size 151936,
    # max_position_embeddings 40960, rope_theta 1e6; model card: 30.5B total, 3.3B activated
    family="llama", name="qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, num_layers=48,
    num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144, max_position=40960,
    rope_theta=1e6, qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
QWEN3_235B_A22B = ModelConfig(
    # Qwen/Qwen3-235B-A22B config.json: hidden_size 4096, num_hidden_layers 94, num_attention_heads 64,
    # num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8,
    # moe_intermediate_size 1536, intermediate_size 12288 (unused), vocab_size 151936,
    # max_position_embeddings 40960, rope_theta 1e6; model card: 235B total, 22B activated
    family="llama", name="qwen3-235b-a22b", vocab_size=151936, hidden_size=4096, num_layers=94,
    num_heads=64, num_kv_heads=4, head_dim=128, intermediate_size=12288, max_position=40960,
    rope_theta=1e6, qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536)
DEEPSEEK_V3_LIKE = ModelConfig(
    # deepseek-ai/DeepSeek-V3 config.json: hidden_size 7168, intermediate_size 18432 (the 3 dense
    # layers), moe_intermediate_size 2048, num_hidden_layers 61, first_k_dense_replace 3,
    # n_routed_experts 256, n_shared_experts 1, num_experts_per_tok 8, num_attention_heads 128,
    # vocab_size 129280, max_position_embeddings 163840; technical report: 671B total, 37B active.
    # "Like": the simulator has no multi-head latent attention (MLA) operator, so attention is
    # grouped-query with DeepSeek's 128 heads of 128 dims (its v_head_dim) and 2 KV heads, which
    # caches 512 values per token and layer where MLA caches 576 (a 512 latent and a 64 rotary key).
    # Full-rank Q and O projections give 674B total (+0.5%) and 40.6B active (+10%).
    family="llama", name="deepseek-v3-like", vocab_size=129280, hidden_size=7168, num_layers=61,
    num_heads=128, num_kv_heads=2, head_dim=128, intermediate_size=18432, max_position=163840,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, num_shared_experts=1,
    first_k_dense_layers=3)

PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (TINY, LLAMA_2_7B, LLAMA_2_13B, LLAMA_3_8B, LLAMA_3_70B, LLAMA_3_1_405B, LLAMA_3_2_1B,
                        GPT2_SMALL, MIXTRAL_8X7B, QWEN3_30B_A3B, QWEN3_235B_A22B, DEEPSEEK_V3_LIKE)
}


def get_preset(name: str) -> ModelConfig:
    """Look a preset up by name (``tiny``, ``llama-2-7b``, ``llama-3-8b``, ...)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]
