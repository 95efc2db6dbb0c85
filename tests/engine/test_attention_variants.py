"""KV bytes per token for MHA, GQA, MQA and MLA from published configurations,
and chapter 13's memory calculator, in Python and in the browser (issue 40)."""
import itertools
import json
import random

import pytest

from minibatch_engine.book.memory_calculator import memory_explorer, model_weight_bytes, plan
from minibatch_engine.model.config import get_preset
from minibatch_engine.sim.attention_variants import ATTENTION_SHAPES, variants_table

from .test_explorables import NODE, run_js


def test_kv_bytes_per_token_from_the_published_shapes():
    kib = {name: s.kv_bytes_per_token() / 1024 for name, s in ATTENTION_SHAPES.items()}
    # 2 (K, V) x layers x KV heads x head_dim x 2 bytes; MLA: layers x (512 + 64) x 2 bytes
    assert kib == {"Llama-2-7B": 512, "Llama-3-8B": 128, "Llama-3-70B": 320, "Falcon-7B": 8,
                   "DeepSeek-V3": 61 * 576 * 2 / 1024}
    assert ATTENTION_SHAPES["DeepSeek-V3"].kv_bytes_per_token("fp8") == 61 * 576
    # the Llama shapes agree with the engine's presets' own formula
    for preset, name in (("llama-2-7b", "Llama-2-7B"), ("llama-3-8b", "Llama-3-8B"), ("llama-3-70b", "Llama-3-70B")):
        assert get_preset(preset).kv_bytes_per_token(2) == ATTENTION_SHAPES[name].kv_bytes_per_token()
        assert ATTENTION_SHAPES[name].embedding_parameters == 2 * get_preset(preset).vocab_size * \
            get_preset(preset).hidden_size


def test_variants_at_one_shape_order_as_the_literature_says():
    llama = ATTENTION_SHAPES["Llama-3-8B"]
    per = {v: llama.kv_elements_per_token_layer(v) for v in ("MHA", "GQA", "MQA", "MLA")}
    assert per == {"MHA": 2 * 32 * 128, "GQA": 2 * 8 * 128, "MQA": 2 * 128, "MLA": 4 * 128 + 64}
    ds = ATTENTION_SHAPES["DeepSeek-V3"]
    assert ds.kv_elements_per_token_layer("MHA") == 128 * (192 + 128)
    assert ds.kv_elements_per_token_layer("MHA") / ds.kv_elements_per_token_layer() > 70


def test_heads_split_over_gpus_but_a_latent_does_not():
    llama, falcon, ds = (ATTENTION_SHAPES[n] for n in ("Llama-3-70B", "Falcon-7B", "DeepSeek-V3"))
    assert llama.kv_bytes_per_token(tensor_parallel_size=8) * 8 == llama.kv_bytes_per_token()
    assert llama.kv_bytes_per_token(tensor_parallel_size=16) == llama.kv_bytes_per_token(tensor_parallel_size=8)
    assert falcon.kv_bytes_per_token(tensor_parallel_size=4) == falcon.kv_bytes_per_token()
    assert ds.kv_bytes_per_token(tensor_parallel_size=8) == ds.kv_bytes_per_token()


def test_the_table_counts_sequences_in_80_gb():
    rows = {r["model"]: r for r in variants_table()}
    assert rows["Llama-3-8B"]["seqs @4k auto"] == int(80e9 // (4096 * 131072))
    for r in rows.values():
        assert r["seqs @4k fp8"] in (2 * r["seqs @4k auto"], 2 * r["seqs @4k auto"] + 1)
        assert r["KiB/token fp8"] * 2 == r["KiB/token auto"]


def test_the_plan_fills_memory_left_by_the_weights():
    p = plan("Llama-3-8B", context=4096)
    s = ATTENTION_SHAPES["Llama-3-8B"]
    left = 0.9 * 80e9 - model_weight_bytes(s)
    assert p["max_batch"] == int(left // (4096 * s.kv_bytes_per_token()))
    assert plan("Llama-3-8B", kv_cache_dtype="fp8")["max_batch"] >= 2 * p["max_batch"]
    assert plan("Llama-3-8B", weight_dtype="int4")["max_batch"] > p["max_batch"]
    assert plan("Llama-3-70B")["max_batch"] == 0 and plan("Llama-3-70B", num_gpus=4)["max_batch"] > 0


@pytest.mark.skipif(NODE is None, reason="needs node")
def test_the_browser_calculator_is_plan():
    e = memory_explorer()
    d = json.dumps(e.data)
    grid = list(itertools.product(
        list(ATTENTION_SHAPES), ["own", "MHA", "GQA", "MQA", "MLA"], ["auto", "fp8", "int8"],
        ["auto", "fp8", "int4"], e.data["contexts"], ["A100-80GB", "H100-SXM", "H200"], ["1", "2", "4", "8"]))
    settings = [dict(zip(("model", "variant", "kv", "weight", "context", "gpu", "gpus"), g))
                for g in random.Random(0).sample(grid, 300)]
    got = run_js(f"{json.dumps(settings)}.map(function (s) {{ return MBE.memoryPlan({d}, s); }})", "memory.js")
    for s, js in zip(settings, got):
        py = plan(s["model"], None if s["variant"] == "own" else s["variant"], s["kv"], s["weight"],
                  s["context"], s["gpu"], int(s["gpus"]))
        assert js["max_batch"] == py["max_batch"], s
        assert js["kv_kib"] == pytest.approx(py["kv_kib_per_token"], rel=1e-6), s
        assert js["weights_gb"] == pytest.approx(py["weights_gb"], rel=1e-5), s
        if py["max_batch"]:
            assert js["step_ms"] == pytest.approx(py["step_ms"], rel=1e-5), s
            assert js["bound"] == py["bound"], s


def test_the_explorable_checks_are_plan_and_its_html_is_stable():
    a, b = memory_explorer(), memory_explorer()
    assert a._repr_html_() == b._repr_html_() and 'id="mbe-ch13-memory"' in a._repr_html_()
    first = a.checks[0]
    assert first["expect"]["max_batch"] == plan("Llama-3-8B")["max_batch"]
    assert any(c["expect"]["max_batch"] == 0 for c in a.checks)      # a model that does not fit is shown
