"""The trained byte-level models ship Hugging Face tokenizer files that give the engine's ids.

Clients such as guidellm and lm-evaluation-harness load a served model's
tokenizer with ``AutoTokenizer.from_pretrained(<the model's folder>)``. For
``tiny-py`` and its draft that must give exactly :class:`ByteTokenizer`'s ids,
the special tokens' ids, and the server's chat template.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minibatch_engine.model import ByteTokenizer, load_tokenizer
from minibatch_engine.model.hf_tokenizer import (SPECIAL_TOKENS, byte_alphabet, tokenizer_config,
                                                 tokenizer_json)
from minibatch_engine.model.trained import TRAINED_MODELS, trained_model_path
from minibatch_engine.entrypoints.server.chat_template import byte_level_chat, load_chat_template

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

MODELS = sorted(TRAINED_MODELS)


@pytest.fixture(scope="module", params=MODELS)
def hf_tok(request):
    return transformers.AutoTokenizer.from_pretrained(str(trained_model_path(request.param)))


def test_the_byte_alphabet_is_gpt2s_printable_spelling():
    from tokenizers import pre_tokenizers
    alphabet = byte_alphabet()
    assert sorted(alphabet) == list(range(256))
    assert set(alphabet.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert alphabet[ord("a")] == "a" and alphabet[ord(" ")] == "\u0120" and alphabet[10] == "\u010a"


@pytest.mark.parametrize("name", MODELS)
def test_committed_files_are_what_the_code_writes(name):
    folder = trained_model_path(name)
    max_length = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    assert (folder / "tokenizer.json").read_text(encoding="utf-8") == tokenizer_json()
    assert json.loads((folder / "tokenizer_config.json").read_text()) == tokenizer_config(max_length)


@pytest.mark.parametrize("name", MODELS)
def test_the_engine_still_uses_its_byte_tokenizer(name):
    assert isinstance(load_tokenizer(trained_model_path(name)), ByteTokenizer)


PROMPTS = ["", "def add(a, b):\n    return a + b\n", "héllo wörld\t\r\n", "日本語 🙂 \x00\x7f",
           "  leading and trailing spaces  ", "<|user|>\nnot a special token\n<|assistant|>\n"]


@pytest.mark.parametrize("text", PROMPTS)
def test_autotokenizer_gives_the_engine_ids(hf_tok, text):
    ids = hf_tok(text)["input_ids"]
    assert ids == ByteTokenizer().encode(text)
    assert hf_tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=64).filter(lambda t: not any(s in t for s, _ in SPECIAL_TOKENS.values())))
def test_autotokenizer_matches_on_any_text(text):
    tok = transformers.AutoTokenizer.from_pretrained(str(trained_model_path("tiny-py")))
    ids = tok(text)["input_ids"]
    assert ids == ByteTokenizer().encode(text)
    assert tok.decode(ids) == text


def test_special_tokens(hf_tok):
    byte = ByteTokenizer()
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (
        byte.bos_token_id, byte.eos_token_id, byte.pad_token_id)
    assert hf_tok.decode([byte.bos_token_id, 104, 105, byte.eos_token_id],
                         skip_special_tokens=True) == "hi"


def test_chat_template_is_the_servers(hf_tok):
    messages = [{"role": "system", "content": "Answer in Python."},
                {"role": "user", "content": "Define a class Point."},
                {"role": "assistant", "content": "class Point:"},
                {"role": "user", "content": "And a method?"}]
    for gen in (True, False):
        expected = byte_level_chat(messages, add_generation_prompt=gen)
        assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == expected
        served = load_chat_template(trained_model_path("tiny-py"))
        assert served(messages, add_generation_prompt=gen) == expected
