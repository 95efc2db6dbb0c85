"""Our loader + model against Hugging Face transformers, on tiny random checkpoints.

Each test builds a small random model with ``transformers``, saves it with
``save_pretrained`` (safetensors), loads the directory with our ``load_model`` and
checks that every-position logits match HF's (float32, atol 1e-4) and that 32 greedy
tokens from our ``reference_generate`` equal HF's ``generate``.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from minibatch_engine import load_model  # noqa: E402
from minibatch_engine.model import full_forward_logits, reference_generate  # noqa: E402

transformers.logging.set_verbosity_error()     # "bos_token_id out of vocab" and the like
try:
    transformers.utils.logging.disable_progress_bar()
except AttributeError:
    pass

VOCAB = 300
ROPE_THETA = 500.0          # far from the 10000 default: a wrongly read theta shows


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Replace HF's init (norm weights 1, biases 0) by random values everywhere, so a
    swapped norm or a dropped bias changes the output; scale keeps logits spread."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1 and "weight" in name:       # norm gains
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 1:                           # biases
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    return model.eval()


def llama_like(model_type: str = "llama", tie: bool = False, seed: int = 0, **extra):
    """A tiny random HF model of the Llama family (GQA: 4 query heads, 2 KV heads)."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                  rope_theta=ROPE_THETA, tie_word_embeddings=tie, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, rms_norm_eps=1e-5)
    kwargs.update(extra)
    if model_type == "llama":
        cls_cfg, cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    elif model_type == "qwen2":
        cls_cfg, cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    elif model_type == "qwen3":
        cls_cfg, cls = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
        kwargs.setdefault("head_dim", 16)
    elif model_type == "mistral":
        cls_cfg, cls = transformers.MistralConfig, transformers.MistralForCausalLM
        kwargs.setdefault("sliding_window", None)
    else:
        raise ValueError(model_type)
    torch.manual_seed(seed)
    return _randomize(cls(cls_cfg(**kwargs)), seed)


def gpt2(tie: bool = True, seed: int = 0):
    """A tiny random HF GPT-2."""
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                  tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
                                  pad_token_id=None)
    torch.manual_seed(seed)
    return _randomize(transformers.GPT2LMHeadModel(cfg), seed)


def save(hf_model, path, **kwargs):
    hf_model.save_pretrained(path, safe_serialization=True, **kwargs) if _accepts_safe_flag() \
        else hf_model.save_pretrained(path, **kwargs)
    assert not list(path.glob("*.bin")), "expected a safetensors checkpoint"
    return path


def _accepts_safe_flag() -> bool:
    # transformers 5 removed the flag (safetensors is the only format); 4.x accepts it.
    return int(transformers.__version__.split(".")[0]) < 5


def rewrite_config(path, edit):
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    edit(cfg)
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return cfg


def assert_parity(hf_model, ours, seed: int = 1, gen_tokens: int = 32):
    """Logits of a few random sequences match, then greedy generation matches."""
    gen = torch.Generator().manual_seed(seed)
    for length in (1, 7, 23):
        ids = torch.randint(0, VOCAB, (length,), generator=gen)
        with torch.no_grad():
            expected = hf_model(ids[None]).logits[0]
        got = full_forward_logits(ours, ids.tolist())
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    prompt = torch.randint(0, VOCAB, (6,), generator=gen)
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf_model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=gen_tokens, eos_token_id=None,
                                pad_token_id=0)
    hf_tokens = out[0, len(prompt):].tolist()
    assert len(hf_tokens) == gen_tokens
    assert reference_generate(ours, prompt.tolist(), gen_tokens) == hf_tokens


# --- Llama family ----------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_llama_parity(tmp_path, tie):
    hf_model = llama_like(tie=tie)
    save(hf_model, tmp_path)
    has_lm_head = "lm_head.weight" in _tensor_names(tmp_path)
    assert has_lm_head == (not tie)
    ours = load_model(tmp_path, device="cpu", dtype="float32")
    cfg = ours.config
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("llama", 4, 2, 16)
    assert cfg.rope_theta == ROPE_THETA and cfg.tie_word_embeddings == tie
    assert cfg.name == tmp_path.name
    assert (ours.lm_head.weight is ours.embed.weight) == tie
    assert not any(p.is_meta for p in ours.parameters())
    assert_parity(hf_model, ours)


def test_llama_sharded_checkpoint(tmp_path):
    hf_model = llama_like(seed=3)
    save(hf_model, tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "expected several shards"
    assert not (tmp_path / "model.safetensors").exists()
    assert_parity(hf_model, load_model(tmp_path, device="cpu", dtype="float32"))


def _as_4x(cfg):
    cfg.pop("rope_parameters", None)
    cfg.pop("dtype", None)
    cfg.pop("rope_scaling", None)
    cfg["rope_theta"] = ROPE_THETA
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = "float32"


def _as_5x(cfg):
    cfg.pop("rope_theta", None)
    cfg.pop("torch_dtype", None)
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_theta": ROPE_THETA, "rope_type": "default"}
    cfg["dtype"] = "float32"


@pytest.mark.parametrize("layout", [_as_4x, _as_5x], ids=["transformers4", "transformers5"])
def test_config_layouts(tmp_path, layout):
    hf_model = llama_like(seed=5)
    save(hf_model, tmp_path)
    rewrite_config(tmp_path, layout)
    ours = load_model(tmp_path, device="cpu")          # dtype from the config
    assert ours.config.rope_theta == ROPE_THETA
    assert ours.dtype == torch.float32
    assert_parity(hf_model, ours, gen_tokens=8)
    # The theta matters: with the default 10000 the logits move well past atol.
    ids = list(range(1, 20))
    right = full_forward_logits(ours, ids)
    ours.config = ours.config.with_(rope_theta=10000.0)
    assert (full_forward_logits(ours, ids) - right).abs().max() > 1e-2


@pytest.mark.parametrize("key,value,expected", [
    ("torch_dtype", "bfloat16", torch.bfloat16), ("dtype", "float16", torch.float16)])
def test_default_dtype_is_the_checkpoints(tmp_path, key, value, expected):
    save(llama_like(seed=6), tmp_path)
    rewrite_config(tmp_path, lambda c: (c.pop("dtype", None), c.pop("torch_dtype", None),
                                        c.__setitem__(key, value)))
    model = load_model(tmp_path, device="cpu")
    assert model.dtype == expected
    assert all(p.dtype == expected for p in model.parameters())
    assert load_model(tmp_path, device="cpu", dtype="float32").dtype == torch.float32


def test_no_dtype_in_config_means_float32(tmp_path):
    save(llama_like(seed=6), tmp_path)
    rewrite_config(tmp_path, lambda c: (c.pop("dtype", None), c.pop("torch_dtype", None)))
    assert load_model(tmp_path, device="cpu").dtype == torch.float32


def test_special_ids_and_eos_list(tmp_path):
    save(llama_like(seed=7), tmp_path)
    rewrite_config(tmp_path, lambda c: c.update(eos_token_id=[5, 7], bos_token_id=3))
    cfg = load_model(tmp_path, device="cpu").config
    assert (cfg.eos_token_id, cfg.bos_token_id) == (5, 3)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral"])
def test_llama_variants_parity(tmp_path, model_type):
    hf_model = llama_like(model_type, seed=8)
    save(hf_model, tmp_path)
    ours = load_model(tmp_path, device="cpu", dtype="float32")
    assert ours.config.attention_bias == (model_type == "qwen2")
    assert ours.config.qk_norm == (model_type == "qwen3")
    assert ours.config.num_parameters() == sum(p.numel() for p in ours.parameters())
    assert_parity(hf_model, ours, gen_tokens=16)


def test_qwen3_norms_are_loaded_not_left_at_one(tmp_path):
    """The q/k norms change the logits: a Qwen3 checkpoint read as if it had none
    (norm weights of one) must not match transformers."""
    hf_model = llama_like("qwen3", seed=9)
    save(hf_model, tmp_path)
    ours = load_model(tmp_path, device="cpu", dtype="float32")
    weights = [m.attn.q_norm.weight for m in ours.layers] + [m.attn.k_norm.weight for m in ours.layers]
    assert all(not torch.allclose(w, torch.ones_like(w)) for w in weights)
    with torch.no_grad():
        for w in weights:
            w.fill_(1.0)
    with pytest.raises(AssertionError):
        assert_parity(hf_model, ours, gen_tokens=4)


# --- GPT-2 -----------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_gpt2_parity(tmp_path, tie):
    hf_model = gpt2(tie=tie, seed=11)
    save(hf_model, tmp_path)
    ours = load_model(tmp_path, device="cpu", dtype="float32")
    cfg = ours.config
    assert (cfg.family, cfg.hidden_size, cfg.intermediate_size, cfg.max_position) == ("gpt2", 64, 256, 128)
    assert (ours.lm_head.weight is ours.embed.weight) == tie
    assert_parity(hf_model, ours)


def test_gpt2_without_transformer_prefix(tmp_path):
    """The original gpt2 upload names tensors ``h.0.attn...`` (no ``transformer.``)
    and carries the causal-mask buffers ``attn.bias``: both must load."""
    from safetensors.torch import load_file, save_file

    hf_model = gpt2(seed=12)
    save(hf_model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    renamed["h.0.attn.bias"] = torch.ones(1, 1, 128, 128)
    save_file(renamed, tmp_path / "model.safetensors")
    assert_parity(hf_model, load_model(tmp_path, device="cpu", dtype="float32"), gen_tokens=8)


def _tensor_names(path):
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())
