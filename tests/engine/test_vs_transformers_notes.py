"""bench --vs-transformers says what to expect before it starts, and says when
its ratio is far from the stored run's (issue 29)."""
from __future__ import annotations

import json

from minibatch_engine.harness import vs_transformers as vt


def test_estimate_names_the_rounds_and_a_time():
    line = vt.estimate_line(64, 64, 3)
    assert "3 rounds" in line
    if vt.STORED.exists():
        assert "min on a quiet machine" in line


def test_a_ratio_far_from_the_stored_one_prints_the_load(monkeypatch):
    stored = {"model": "tiny", "num_requests": 64, "cpu": "X (2 CPUs)", "load_average_at_end": 0.5,
              "engine_vs_hf_continuous": 16.4}
    monkeypatch.setattr(vt, "_stored", lambda: stored)
    run = dict(stored, engine_vs_hf_continuous=1.46, load_average_at_end=7.5)
    note = vt.stored_difference(run)
    assert note is not None and "1.46x" in note and "16.40x" in note and "7.50" in note
    assert "busy machine distorts the ratio" in note
    assert vt.stored_difference(dict(stored, engine_vs_hf_continuous=12.0)) is None
    assert vt.stored_difference(dict(run, num_requests=8)) is None   # another run: no comparison
    json.dumps(run)
