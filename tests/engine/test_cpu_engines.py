"""The other CPU engines of ``bench --vs-openvino --also``: each adapter's greedy
tokens equal the engine's on a small checkpoint (where the system is
installed), a missing system is skipped with its reason, and a wrong name is
refused. Their timings are not tested."""
from __future__ import annotations

import importlib.util
import shutil
import sys

import pytest

from minibatch_engine.entrypoints.cli import main
from minibatch_engine.harness import cpu_engines
from minibatch_engine.harness.cpu_engines import OTHERS, Unavailable, prepare


def engine_tokens(checkpoint, prompts, max_tokens):
    from minibatch_engine.harness.vs_transformers import run_engine
    from minibatch_engine.model.registry import resolve_model
    model = resolve_model(str(checkpoint), device="cpu", dtype="float32")
    return run_engine(model, prompts, max_tokens, batch=4, attention_backend="auto")


PROMPTS = [[5, 9, 200, 31, 7], [1] * 3, list(range(40, 77)), [250, 3, 3, 3, 3, 3, 3, 17]]
MAX_TOKENS = [12, 3, 20, 1]


def installed(name: str) -> bool:
    if name == "llama.cpp":
        return cpu_engines.llama_server_binary() is not None and importlib.util.find_spec("gguf") is not None
    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize("name", OTHERS)
def test_greedy_tokens_equal_the_engines(name, two_layer_checkpoint, tmp_path):
    if not installed(name):
        pytest.skip(f"{name} is not installed")
    other = prepare(name, two_layer_checkpoint, "k", tmp_path, batch=4, threads=2, log=lambda *a: None)
    try:
        got = other.run(PROMPTS, MAX_TOKENS)
    finally:
        other.close()
    assert [len(t) for t in got] == MAX_TOKENS
    assert got == engine_tokens(two_layer_checkpoint, PROMPTS, MAX_TOKENS)
    assert other.version and other.settings


def test_a_missing_system_is_unavailable_with_its_install_line(monkeypatch, two_layer_checkpoint, tmp_path):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)      # import fails
    with pytest.raises(Unavailable, match="pip install ctranslate2"):
        prepare("ctranslate2", two_layer_checkpoint, "k", tmp_path, batch=4, threads=2)
    monkeypatch.setattr(shutil, "which", lambda *_: None)
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    with pytest.raises(Unavailable, match="llama-server"):
        prepare("llama.cpp", two_layer_checkpoint, "k", tmp_path, batch=4, threads=2)


def test_unknown_system_is_refused(two_layer_checkpoint, tmp_path, capsys):
    with pytest.raises(ValueError, match="--also takes"):
        prepare("vllm", two_layer_checkpoint, "k", tmp_path, batch=4, threads=2)
    assert main(["bench", "--also", "ctranslate2", "--no-progress"]) == 2
    assert "add --vs-openvino" in capsys.readouterr().err


def test_a_system_in_its_own_process_gives_the_same_tokens(two_layer_checkpoint, tmp_path, monkeypatch):
    """``start``: the system runs in a spawned process; tokens come back over the
    pipe, a missing system raises Unavailable here, and close ends the process."""
    from minibatch_engine.harness.cpu_engines import start
    lines = []
    other = start("ctranslate2" if installed("ctranslate2") else "transformers", two_layer_checkpoint, "k",
                  tmp_path, batch=4, threads=2, log=lines.append)
    try:
        assert other.run(PROMPTS, MAX_TOKENS) == engine_tokens(two_layer_checkpoint, PROMPTS, MAX_TOKENS)
    finally:
        other.close()
    if other.name == "ctranslate2":          # its conversion's progress line came back through log
        assert any("converting" in line for line in lines)
    monkeypatch.setenv("LLAMA_SERVER", "")
    monkeypatch.setenv("PATH", str(tmp_path))            # no llama-server anywhere
    with pytest.raises(Unavailable, match="llama-server"):
        start("llama.cpp", two_layer_checkpoint, "k", tmp_path, batch=4, threads=2)


def test_gguf_holds_the_checkpoint_for_llama_cpp(two_layer_checkpoint, tmp_path):
    """write_gguf: every weight in f32, query and key rows in llama.cpp's rotary
    order (undone here, they equal the two_layer_checkpoint's), the shapes llama.cpp
    reads, and a vocabulary with no BOS or EOS (so ignore_eos masks nothing)."""
    gguf = pytest.importorskip("gguf")
    import json

    import numpy as np
    from safetensors.torch import load_file
    out = tmp_path / "m.gguf"
    cpu_engines.write_gguf(two_layer_checkpoint, out)
    cfg = json.loads((two_layer_checkpoint / "config.json").read_text())
    hf = {}
    for f in two_layer_checkpoint.glob("*.safetensors"):
        hf.update({k: v.numpy() for k, v in load_file(str(f)).items()})
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    assert len(tensors) == 3 + 9 * cfg["num_hidden_layers"]
    d = cfg["hidden_size"] // cfg["num_attention_heads"]

    def unpair(w, n):
        return w.reshape(n, d // 2, 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        assert not np.array_equal(tensors[f"blk.{i}.attn_q.weight"], hf[p + "q_proj.weight"])
        np.testing.assert_array_equal(unpair(tensors[f"blk.{i}.attn_q.weight"], cfg["num_attention_heads"]),
                                      hf[p + "q_proj.weight"])
        np.testing.assert_array_equal(unpair(tensors[f"blk.{i}.attn_k.weight"], cfg["num_key_value_heads"]),
                                      hf[p + "k_proj.weight"])
        np.testing.assert_array_equal(tensors[f"blk.{i}.ffn_down.weight"], hf[f"model.layers.{i}.mlp.down_proj.weight"])
    np.testing.assert_array_equal(tensors["output.weight"], hf["lm_head.weight"])
    fields = reader.fields
    value = lambda key: fields[key].parts[fields[key].data[0]][0]   # noqa: E731
    assert value("llama.attention.head_count_kv") == cfg["num_key_value_heads"]
    assert value("llama.rope.dimension_count") == d
    assert len(fields["tokenizer.ggml.tokens"].data) == cfg["vocab_size"]
    assert "tokenizer.ggml.eos_token_id" not in fields and "tokenizer.ggml.bos_token_id" not in fields
