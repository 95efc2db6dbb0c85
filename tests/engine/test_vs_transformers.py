"""The checkpoint export behind ``bench --vs-transformers``, and its clear error
when transformers is missing (the benchmark itself is not a timed test)."""
from __future__ import annotations

import sys

import pytest
import torch

from minibatch_engine import load_model
from minibatch_engine.entrypoints.cli import main


def test_missing_transformers_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)     # import fails
    assert main(["bench", "--vs-transformers", "--no-progress"]) == 2
    assert "pip install transformers" in capsys.readouterr().err


def test_export_round_trips_and_matches_transformers(tiny32, tmp_path):
    pytest.importorskip("transformers")
    from minibatch_engine.model import full_forward_logits
    from minibatch_engine.model.hf_export import save_hf_checkpoint
    hf = save_hf_checkpoint(tiny32, tmp_path)
    back = load_model(tmp_path, device="cpu", dtype="float32")
    assert all(torch.equal(a, b) for a, b in zip(tiny32.state_dict().values(), back.state_dict().values()))
    ids = [5, 17, 200, 3, 99, 42]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(full_forward_logits(tiny32, ids), theirs, atol=1e-4)
