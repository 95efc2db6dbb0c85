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


def test_the_compared_engine_holds_the_workloads_longest_request(tiny32):
    """engine_for (every CPU comparison's engine) sizes max_model_len for the
    longest prompt + output (multi-turn prompts pass the default 1024), keeps
    the default where that is longer, and passes other knobs through."""
    from minibatch_engine.harness.vs_transformers import engine_for
    eng, reqs = engine_for(tiny32, [[1] * 900, [2] * 10], [300, 5], 2, "auto", 1, enable_prefix_caching=False)
    assert eng.config.max_model_len == 1200 and not eng.config.enable_prefix_caching and len(reqs) == 2
    assert engine_for(tiny32, [[1] * 10], [5], 1, "auto", 1)[0].config.max_model_len == 1024
