"""KV bytes per token for the four attention variants, from published configurations.

What a decoder caches per token and layer decides how many tokens fit in memory:

* **MHA** (multi-head attention, Vaswani et al. 2017): a K and a V vector for
  every head, ``2 x heads x head_dim`` elements.
* **MQA** (multi-query attention, Shazeer 2019): all query heads share one K
  and one V head, ``2 x head_dim``.
* **GQA** (grouped-query attention, Ainslie et al. 2023): groups of query heads
  share a K/V head, ``2 x kv_heads x head_dim``; MHA and MQA are its two ends.
* **MLA** (multi-head latent attention, DeepSeek-V2 2024): one compressed latent
  ``c_KV`` of ``kv_lora_rank`` elements and one shared rotary key of
  ``qk_rope_head_dim`` elements; the per-head K and V are up-projections of the
  latent, which the query and output projections absorb at decode time, so they
  are never cached.

Per token, all layers: ``layers x elements per layer x bytes per element``.
Each configuration below is copied from the model's published ``config.json``
(Hugging Face hub), with its source next to it. Parameter counts are the ones
the model cards publish (the weights take ``parameters x 2`` bytes in bf16).
"""
from __future__ import annotations

from dataclasses import dataclass

from .precision import kv_bytes_per_element

GIB = 2**30
VARIANTS = ("MHA", "GQA", "MQA", "MLA")


@dataclass(frozen=True)
class AttentionShape:
    """A published model's shape, as far as its KV cache and weights go. For
    MLA, ``head_dim`` is the per-head key it would cache without compression
    (``qk_nope + qk_rope`` dims) and ``v_head_dim`` the per-head value;
    ``latent_dim`` and ``rope_dim`` are what it caches instead."""
    name: str
    variant: str            # "MHA", "GQA", "MQA" or "MLA"
    num_layers: int
    num_heads: int          # query heads
    kv_heads: int           # K/V heads cached (MLA: the heads its latent stands for)
    head_dim: int           # per-head key dims (= value dims unless v_head_dim says otherwise)
    parameters: float       # published parameter count (all experts for a mixture of experts)
    vocab_size: int
    hidden_size: int
    tied_embeddings: bool
    source: str
    active_parameters: float | None = None   # mixture of experts: parameters one token runs through
    latent_dim: int = 0     # MLA: kv_lora_rank
    rope_dim: int = 0       # MLA: qk_rope_head_dim (the decoupled rotary key, shared by all heads)
    v_head_dim: int = 0     # MLA: the expanded value's dims per head

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def embedding_parameters(self) -> int:
        """The embedding and the LM head (one matrix when they are tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def kv_elements_per_token_layer(self, variant: str | None = None, tensor_parallel_size: int = 1) -> int:
        """Elements one token caches in one layer on one GPU of a
        ``tensor_parallel_size`` group. ``variant`` (default: the model's own)
        asks what another variant would cache at this model's shape: ``"MHA"``
        a K and V per query head, ``"GQA"`` the model's KV heads if it has
        grouped queries, else 8 (Llama 3's choice), ``"MQA"`` one, ``"MLA"`` the
        model's latent and rotary key, else DeepSeek's ratio (a latent of 4
        head dims and a rotary key of half of one). Heads are split across the
        GPUs (and replicated when there are fewer than GPUs); an MLA latent is
        one vector for all heads, so every GPU caches all of it."""
        variant = variant or self.variant
        if variant == "MLA":
            if self.variant == "MLA":
                return self.latent_dim + self.rope_dim
            return 4 * self.head_dim + self.head_dim // 2
        heads = {"MHA": self.num_heads, "MQA": 1,
                 "GQA": self.kv_heads if self.variant == "GQA" else min(8, self.num_heads)}[variant]
        return -(-heads // tensor_parallel_size) * (self.head_dim + self.v_dim)

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto", variant: str | None = None,
                           tensor_parallel_size: int = 1) -> int:
        """Bytes of KV cache per token, all layers, on one GPU (``"auto"``: bf16)."""
        return (self.num_layers * self.kv_elements_per_token_layer(variant, tensor_parallel_size)
                * kv_bytes_per_element(kv_cache_dtype))

    def max_sequences(self, context: int, kv_memory_bytes: float, kv_cache_dtype: str = "auto") -> int:
        """Sequences of ``context`` tokens whose KV fits in ``kv_memory_bytes``."""
        return int(kv_memory_bytes // (context * self.kv_bytes_per_token(kv_cache_dtype)))


# --- published configurations ---------------------------------------------------------
LLAMA_2_7B = AttentionShape(
    "Llama-2-7B", "MHA", num_layers=32, num_heads=32, kv_heads=32, head_dim=128, parameters=6.74e9,
    vocab_size=32000, hidden_size=4096, tied_embeddings=False,
    # meta-llama/Llama-2-7b-hf config.json: num_hidden_layers 32, num_attention_heads 32,
    # num_key_value_heads 32, hidden_size 4096 (head_dim 4096 / 32); 6.74B parameters (model card)
    source="meta-llama/Llama-2-7b-hf config.json")
LLAMA_3_8B = AttentionShape(
    "Llama-3-8B", "GQA", num_layers=32, num_heads=32, kv_heads=8, head_dim=128, parameters=8.03e9,
    vocab_size=128256, hidden_size=4096, tied_embeddings=False,
    # meta-llama/Meta-Llama-3-8B config.json: num_hidden_layers 32, num_attention_heads 32,
    # num_key_value_heads 8, hidden_size 4096; 8.03B parameters (model card)
    source="meta-llama/Meta-Llama-3-8B config.json")
LLAMA_3_70B = AttentionShape(
    "Llama-3-70B", "GQA", num_layers=80, num_heads=64, kv_heads=8, head_dim=128, parameters=70.6e9,
    vocab_size=128256, hidden_size=8192, tied_embeddings=False,
    # meta-llama/Meta-Llama-3-70B config.json: num_hidden_layers 80, num_attention_heads 64,
    # num_key_value_heads 8, hidden_size 8192; 70.6B parameters (model card)
    source="meta-llama/Meta-Llama-3-70B config.json")
FALCON_7B = AttentionShape(
    "Falcon-7B", "MQA", num_layers=32, num_heads=71, kv_heads=1, head_dim=64, parameters=6.92e9,
    vocab_size=65024, hidden_size=4544, tied_embeddings=True,
    # tiiuae/falcon-7b config.json: n_layer 32, n_head 71, multi_query true (one K/V head),
    # hidden_size 4544 (head_dim 4544 / 71 = 64); 6.92B parameters counted from these shapes
    # (MLP 4 x 4544, vocab_size 65024, tied embeddings; the model card rounds to 7B)
    source="tiiuae/falcon-7b config.json")
DEEPSEEK_V3 = AttentionShape(
    "DeepSeek-V3", "MLA", num_layers=61, num_heads=128, kv_heads=128, head_dim=128 + 64, parameters=671e9,
    vocab_size=129280, hidden_size=7168, tied_embeddings=False, active_parameters=37e9,
    latent_dim=512, rope_dim=64, v_head_dim=128,
    # deepseek-ai/DeepSeek-V3 config.json: num_hidden_layers 61, num_attention_heads 128,
    # kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128,
    # hidden_size 7168, vocab_size 129280, tie_word_embeddings false;
    # 671B parameters, 37B active per token (DeepSeek-V3 technical report)
    source="deepseek-ai/DeepSeek-V3 config.json")

ATTENTION_SHAPES: dict[str, AttentionShape] = {
    s.name: s for s in (LLAMA_2_7B, LLAMA_3_8B, LLAMA_3_70B, FALCON_7B, DEEPSEEK_V3)}


def variants_table(contexts=(4096, 32768), kv_memory_bytes: float = 80e9,
                   kv_dtypes=("auto", "fp8")) -> list[dict]:
    """One row per published model: its variant, KV KiB per token in each KV dtype,
    and the sequences of each context whose KV fits in ``kv_memory_bytes`` (80 GB:
    one H100's memory, as if the weights lived elsewhere)."""
    rows = []
    for s in ATTENTION_SHAPES.values():
        row = {"model": s.name, "variant": s.variant, "layers": s.num_layers,
               "cached per layer": s.kv_elements_per_token_layer(),
               "as MHA per layer": s.kv_elements_per_token_layer("MHA")}
        for d in kv_dtypes:
            row[f"KiB/token {d}"] = s.kv_bytes_per_token(d) / 1024
        for c in contexts:
            for d in kv_dtypes:
                row[f"seqs @{c // 1024}k {d}"] = s.max_sequences(c, kv_memory_bytes, d)
        rows.append(row)
    return rows
