"""Model configuration and the one place where presets are defined.

A :class:`ModelConfig` describes a decoder-only transformer of either family the
engine runs: ``"llama"`` (RMSNorm, rotary positions, grouped-query attention,
SwiGLU) or ``"gpt2"`` (LayerNorm, learned positions, GELU). The same dataclass
also feeds the KV-cache memory formula and the roofline simulator, so the shapes
of published models (Llama-2-7B, Llama-3-8B, ...) live here too.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

FAMILIES = ("llama", "gpt2")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer."""

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

    # --- sizes the book keeps asking for -------------------------------------------
    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Bytes of K and V one token occupies in the cache, all layers together:
        2 x layers x kv_heads x head_dim x bytes_per_element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Parameter count from the shapes alone (matches the module's own count)."""
        d, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = d * (q + 2 * kv) + q * d
        if self.family == "llama":
            mlp = 3 * d * self.intermediate_size
            norms = 2 * d
            bias = (q + 2 * kv) if self.attention_bias else 0
            norms += 2 * hd if self.qk_norm else 0
        else:  # gpt2: biases everywhere, LayerNorm has weight and bias
            mlp = 2 * d * self.intermediate_size + self.intermediate_size + d
            norms = 4 * d
            bias = (q + 2 * kv) + d
        per_layer = attn + mlp + norms + bias
        total = self.num_layers * per_layer + (2 * d if self.family == "gpt2" else d)
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

PRESETS: dict[str, ModelConfig] = {
    c.name: c for c in (TINY, LLAMA_2_7B, LLAMA_2_13B, LLAMA_3_8B, LLAMA_3_70B, LLAMA_3_1_405B, LLAMA_3_2_1B,
              GPT2_SMALL)
}


def get_preset(name: str) -> ModelConfig:
    """Look a preset up by name (``tiny``, ``llama-2-7b``, ``llama-3-8b``, ...)."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]
