"""The checkpoint loader refuses bad checkpoints with errors that name the problem;
the tokenizers round-trip text.

Checkpoints here are written by hand (config.json + safetensors), without
transformers, so each test can break exactly one thing.
"""
from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from minibatch_engine.model import (ByteTokenizer, CheckpointError, HFTokenizer, load_model,
                                    load_tokenizer)
from minibatch_engine.model.config import BOS_ID, EOS_ID, PAD_ID

H, LAYERS, HEADS, KV_HEADS, INTER, VOCAB = 32, 1, 4, 2, 48, 50


def llama_config(**changes) -> dict:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB,
           "hidden_size": H, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "intermediate_size": INTER,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
           "dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    cfg.update(changes)
    return cfg


def llama_tensors() -> dict[str, torch.Tensor]:
    hd = H // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,),
              "lm_head.weight": (VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (HEADS * hd, H),
            p + "self_attn.k_proj.weight": (KV_HEADS * hd, H),
            p + "self_attn.v_proj.weight": (KV_HEADS * hd, H),
            p + "self_attn.o_proj.weight": (H, HEADS * hd),
            p + "mlp.gate_proj.weight": (INTER, H), p + "mlp.up_proj.weight": (INTER, H),
            p + "mlp.down_proj.weight": (H, INTER)})
    gen = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=gen) * 0.1 for k, s in shapes.items()}


def write_checkpoint(path, config=None, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(llama_config() if config is None else config))
    save_file(llama_tensors() if tensors is None else tensors, path / "model.safetensors")
    return path


def test_valid_handmade_checkpoint_loads(tmp_path):
    model = load_model(write_checkpoint(tmp_path / "ok"), device="cpu")
    assert model.config.name == "ok" and model.config.num_kv_heads == KV_HEADS
    assert issubclass(CheckpointError, ValueError)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nowhere")
    f = tmp_path / "file.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(f)


def test_missing_config(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_model(tmp_path)


def test_unknown_model_type(tmp_path):
    write_checkpoint(tmp_path, config=llama_config(model_type="falcon",
                                                   architectures=["FalconForCausalLM"]))
    with pytest.raises(CheckpointError, match=r"unknown architecture.*'falcon'.*supported.*gpt2.*llama"):
        load_model(tmp_path)


class _Boom:
    """Unpickling this would run os.system: the loader must never unpickle."""

    def __reduce__(self):
        import os
        return (os.system, ("touch UNPICKLED_MARKER",))


@pytest.mark.parametrize("payload", ["pickle", "garbage"])
def test_pickle_checkpoint_refused(tmp_path, monkeypatch, payload):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(llama_config()))
    data = pickle.dumps(_Boom()) if payload == "pickle" else bytes(range(256)) * 4
    (ckpt / "pytorch_model.bin").write_bytes(data)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"only safetensors.*pytorch_model\.bin"):
        load_model(ckpt)
    assert not (tmp_path / "UNPICKLED_MARKER").exists()


def test_no_weights_file(tmp_path):
    tmp_path.joinpath("config.json").write_text(json.dumps(llama_config()))
    with pytest.raises(CheckpointError, match="no safetensors weights file"):
        load_model(tmp_path)


def test_index_names_missing_shard(tmp_path):
    tensors = llama_tensors()
    names = sorted(tensors)
    half = len(names) // 2
    (tmp_path / "config.json").write_text(json.dumps(llama_config()))
    shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({k: tensors[k] for k in names[:half]}, tmp_path / shard1)
    save_file({k: tensors[k] for k in names[half:]}, tmp_path / shard2)
    weight_map = {k: (shard1 if i < half else shard2) for i, k in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    load_model(tmp_path, device="cpu")                 # complete: loads
    (tmp_path / shard2).unlink()
    with pytest.raises(CheckpointError, match="missing.*model-00002-of-00002.safetensors"):
        load_model(tmp_path)


def test_missing_tensor(tmp_path):
    tensors = llama_tensors()
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    write_checkpoint(tmp_path, tensors=tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*missing"):
        load_model(tmp_path)


def test_untied_without_lm_head_is_missing_tensor(tmp_path):
    tensors = llama_tensors()
    del tensors["lm_head.weight"]
    write_checkpoint(tmp_path, tensors=tensors)
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' is missing"):
        load_model(tmp_path)
    write_checkpoint(tmp_path, config=llama_config(tie_word_embeddings=True), tensors=tensors)
    model = load_model(tmp_path, device="cpu")         # tied: the embedding serves
    assert model.lm_head.weight is model.embed.weight


def test_wrong_shape(tmp_path):
    tensors = llama_tensors()
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(INTER + 1, H)
    write_checkpoint(tmp_path, tensors=tensors)
    with pytest.raises(CheckpointError,
                       match=rf"mlp\.up_proj\.weight.*shape \[{INTER + 1}, {H}\], expected \[{INTER}, {H}\]"):
        load_model(tmp_path)


def test_extra_tensors_are_ignored(tmp_path):
    tensors = llama_tensors()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    load_model(write_checkpoint(tmp_path, tensors=tensors), device="cpu")


@pytest.mark.parametrize("config", [
    llama_config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}),
    llama_config(rope_parameters=None, rope_theta=500000.0,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0}),
    llama_config(rope_parameters=None, rope_scaling={"type": "llama3", "factor": 8.0}),
], ids=["5.x-rope_parameters", "4.x-rope_scaling", "old-type-key"])
def test_rope_scaling_refused(tmp_path, config):
    write_checkpoint(tmp_path, config=config)
    with pytest.raises(NotImplementedError, match="RoPE scaling type 'llama3'"):
        load_model(tmp_path)


def test_yarn_refused_with_checkpoint_error_too(tmp_path):
    write_checkpoint(tmp_path, config=llama_config(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}))
    with pytest.raises(CheckpointError, match="'yarn'"):
        load_model(tmp_path)


def test_mistral_sliding_window_refused(tmp_path):
    write_checkpoint(tmp_path, config=llama_config(model_type="mistral", sliding_window=16))
    with pytest.raises(NotImplementedError, match="sliding_window=16"):
        load_model(tmp_path)
    write_checkpoint(tmp_path, config=llama_config(model_type="mistral", sliding_window=None))
    load_model(tmp_path, device="cpu")


def test_unknown_dtype(tmp_path):
    write_checkpoint(tmp_path, config=llama_config(dtype="float8"))
    with pytest.raises(CheckpointError, match="unknown dtype 'float8'"):
        load_model(tmp_path)


# --- tokenizers -----------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld: 日本語 ✓ 🙂\n\ttabs"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True) == [BOS_ID] + ids
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok.vocab_size == 260


def test_byte_tokenizer_skips_specials_and_replaces_bad_bytes():
    tok = ByteTokenizer()
    assert tok.decode([BOS_ID, *tok.encode("ab"), EOS_ID, PAD_ID, PAD_ID]) == "ab"
    assert tok.decode([0xE6, 0x97]) == "\ufffd"          # a cut multi-byte character
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([300])


def test_load_tokenizer_tiny():
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)


def _tiny_bpe_checkpoint(path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog", "serving many requests at once",
              "continuous batching keeps the GPU busy", "paged attention stores the kv cache"] * 20
    tok.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps(llama_config(
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=[tok.token_to_id("</s>"), 99],
        pad_token_id=tok.token_to_id("<pad>"))))
    return tok


def test_hf_tokenizer(tmp_path):
    raw = _tiny_bpe_checkpoint(tmp_path / "ckpt")
    tok = load_tokenizer(tmp_path / "ckpt")
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_token_id == raw.token_to_id("</s>")       # first of the list
    assert tok.bos_token_id == raw.token_to_id("<s>")
    assert tok.pad_token_id == raw.token_to_id("<pad>")
    assert tok.vocab_size == raw.get_vocab_size()
    text = "the lazy GPU serves paged requests, ünïcode too"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())                     # merges were learned
    assert tok.decode(ids) == text
    with_bos = tok.encode(text, add_bos=True)
    assert with_bos == [tok.bos_token_id] + ids
    assert tok.decode(with_bos + [tok.eos_token_id, tok.pad_token_id]) == text


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="only describes shapes"):
        load_tokenizer("llama-2-7b")



@pytest.mark.parametrize("content,problem", [
    ("{\"model\": {\"type\": \"BPE\"", "is not valid JSON"),
    ("[1, 2, 3]", "should hold a JSON object, got list"),
    ("\"just a string\"", "should hold a JSON object, got str"),
    (b"\xff\xfe{}", "is not valid JSON"),
], ids=["truncated", "list", "string", "not-utf8"])
def test_corrupt_tokenizer_json_names_the_file(tmp_path, content, problem):
    (tmp_path / "tokenizer.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CheckpointError, match=problem) as err:
        load_tokenizer(tmp_path)
    assert "tokenizer.json" in str(err.value) and str(tmp_path) in str(err.value)


def test_tokenizer_json_object_that_is_no_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text(json.dumps({"hello": "world"}))
    with pytest.raises(CheckpointError, match="tokenizer.json in .* is not a tokenizer"):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_config_names_the_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="tokenizer_config.json in .* is not valid JSON"):
        load_tokenizer(tmp_path)


def test_checkpoint_declares_the_byte_tokenizer(tmp_path):
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"minibatch_engine_tokenizer": "byte", "eos_token_id": EOS_ID}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_id == EOS_ID
    cfg.write_text(json.dumps({"minibatch_engine_tokenizer": "byte", "eos_token_id": 2}))
    with pytest.raises(CheckpointError, match="eos_token_id=2, but the byte tokenizer's "
                                              f"eos_token_id is {EOS_ID}"):
        load_tokenizer(tmp_path)
    cfg.write_text(json.dumps({"minibatch_engine_tokenizer": "unicorn"}))
    with pytest.raises(CheckpointError, match="'unicorn'; the only one built in is 'byte'"):
        load_tokenizer(tmp_path)
