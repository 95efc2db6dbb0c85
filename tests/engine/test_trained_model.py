"""The committed trained checkpoints ``tiny-py`` and ``tiny-py-draft``.

They load through ``load_model`` like any Hugging Face checkpoint, their logits
equal ``transformers``' ``LlamaForCausalLM`` on the same folder (float32, atol 1e-4
as in ``test_hf_parity.py``), they are actually trained (low loss on Python code
they never saw), greedy text is printable, and draft and target share one
vocabulary and tokenizer, as speculative decoding requires.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minibatch_engine.model import ByteTokenizer, load_model, load_tokenizer, reference_generate
from minibatch_engine.model.config import BOS_ID, EOS_ID, PAD_ID, TINY
from minibatch_engine.model.reference import full_forward_logits
from minibatch_engine.model.trained import TRAINED_MODELS, WEIGHTS_DIR, trained_model_path

ROOT = Path(__file__).resolve().parents[2]
# Python the models never saw (written for this test, not from the standard library).
UNSEEN_CODE = '''import os


def read_settings(path, defaults=None):
    """Return the settings in path, merged over defaults."""
    settings = dict(defaults or {})
    if not os.path.exists(path):
        return settings
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            settings[key.strip()] = value.strip()
    return settings


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value
'''
NAMES = sorted(TRAINED_MODELS)
TRAINED_CONTEXT = 256       # tools/train_tiny.py --seq-len


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
    path = trained_model_path(request.param)
    return request.param, path, load_model(path, device="cpu", dtype="float32")


def test_known_names_and_clear_error():
    assert set(TRAINED_MODELS) == {"tiny-py", "tiny-py-draft"}
    for name in TRAINED_MODELS:
        assert trained_model_path(name) == WEIGHTS_DIR / name
    with pytest.raises(ValueError, match="unknown trained model 'tiny-python'; known: "
                                         "tiny-py, tiny-py-draft"):
        trained_model_path("tiny-python")


def test_shapes(loaded):
    name, _, model = loaded
    cfg = model.config
    expected = TINY.with_(name=name, num_layers=4 if name == "tiny-py" else 1)
    assert cfg == expected, "the trained models have the tiny preset's shape (the draft: 1 layer)"
    assert (cfg.bos_token_id, cfg.eos_token_id) == (BOS_ID, EOS_ID)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_stored_dtype_is_bfloat16():
    model = load_model(trained_model_path("tiny-py-draft"), device="cpu")     # dtype=None
    assert model.dtype == torch.bfloat16


def test_logits_match_transformers(loaded):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    name, path, ours = loaded
    major = int(transformers.__version__.split(".")[0])
    kwargs = {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}
    hf = transformers.LlamaForCausalLM.from_pretrained(path, **kwargs).eval()
    ids = [BOS_ID] + list(UNSEEN_CODE[:200].encode())
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = full_forward_logits(ours, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # greedy continuation agrees token for token
    prompt = list(b"def __init__(self")
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=PAD_ID)
    assert reference_generate(ours, prompt, 16) == out[0, len(prompt):].tolist()


def bits_per_byte(model, text: str) -> float:
    ids = ([BOS_ID] + list(text.encode()))[:TRAINED_CONTEXT]
    logits = full_forward_logits(model, ids[:-1])
    return F.cross_entropy(logits, torch.tensor(ids[1:])).item() / math.log(2)


def test_trained_not_random():
    """On Python they never saw, both models need far fewer bits per byte than a
    uniform guess (8), and the target fewer than its one-layer draft. (The seeded
    random ``tiny`` needs more than 8: confidently wrong.) Only the trained context
    is scored: past 256 positions, never seen in training, both models get worse."""
    target, draft = (load_model(trained_model_path(n), device="cpu", dtype="float32")
                     for n in ("tiny-py", "tiny-py-draft"))
    t, d = bits_per_byte(target, UNSEEN_CODE), bits_per_byte(draft, UNSEEN_CODE)
    assert t < d < 4.0, f"tiny-py {t:.2f}, tiny-py-draft {d:.2f} bits per byte"


def test_greedy_text_is_printable(loaded):
    name, path, model = loaded
    tok = load_tokenizer(path)
    out = reference_generate(model, tok.encode("import "), 32)
    assert all(i < 256 or i == EOS_ID for i in out), "only bytes (and perhaps EOS) come out"
    text = tok.decode(out)
    assert "\ufffd" not in text, f"{name} produced invalid UTF-8: {text!r}"
    assert all(c.isprintable() or c in "\n\t" for c in text), f"{name}: {text!r}"


def test_draft_and_target_share_the_vocabulary():
    target, draft = (trained_model_path(n) for n in ("tiny-py", "tiny-py-draft"))
    toks = [load_tokenizer(target), load_tokenizer(draft)]
    cfgs = [load_model(p, device="cpu").config for p in (target, draft)]
    for tok, cfg in zip(toks, cfgs):
        assert isinstance(tok, ByteTokenizer)
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
        assert tok.vocab_size == cfg.vocab_size
        assert tok.eos_token_id == cfg.eos_token_id
    t, d = cfgs
    assert t.vocab_size == d.vocab_size and t.num_layers > d.num_layers
    assert (t.num_kv_heads, t.head_dim) == (d.num_kv_heads, d.head_dim)   # same KV layout per layer


def test_package_data_ships_every_weight_file():
    """Every file in the weights folders matches a package-data pattern in
    pyproject.toml, so a non-editable install carries the checkpoints."""
    tomllib = pytest.importorskip("tomllib")
    import fnmatch

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["minibatch_engine.model"]
    package = ROOT / "minibatch_engine" / "model"
    files = [f.relative_to(package).as_posix() for f in WEIGHTS_DIR.rglob("*") if f.is_file()]
    assert files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not missing, f"not shipped by pyproject.toml package-data: {missing}"
