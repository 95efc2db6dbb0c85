"""Stored sweeps (minibatch_engine/book/stored_runs.py): read back, checked on a
sample, refused when stale, written again on request; and the chapters' stored
files hold the runs their cells ask for."""
from __future__ import annotations

import json

import pytest

from minibatch_engine.book import stored_runs as sr

POINTS = [(s, b) for b in (8, 32) for s in (0.0, 0.5)]


def run(point):
    s, b = point
    return {"gain": 1 + s * b / 10, "steps": b * 3, "rows": [b, None, "x"]}


def test_recompute_writes_every_run_then_reading_reruns_only_the_check(tmp_path, monkeypatch, capsys):
    calls = []
    counted = lambda p: calls.append(p) or run(p)                    # noqa: E731
    monkeypatch.setenv(sr.RECOMPUTE_ENV, "1")
    first = sr.stored_runs("grid", POINTS, counted, check=[(0.5, 8)], store=tmp_path)
    assert calls == POINTS                                            # every run, each once
    lines = (tmp_path / "grid.json").read_text().splitlines()
    assert len(lines) == 2 + len(POINTS)                              # one run a line
    monkeypatch.delenv(sr.RECOMPUTE_ENV)
    calls.clear()
    again = sr.stored_runs("grid", POINTS, counted, check=[(0.0, 32)], store=tmp_path)
    assert calls == [(0.0, 32)]
    assert again == first and list(again) == POINTS
    assert again[0.5, 8] == {"gain": 1.4, "steps": 24, "rows": [8, None, "x"]}   # JSON's types
    out = capsys.readouterr().out.splitlines()
    assert out[0] == out[1] == "4 runs read from grid.json; the 1 rerun here equal their stored results"


def test_a_run_that_no_longer_gives_its_stored_result_fails_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv(sr.RECOMPUTE_ENV, "1")
    sr.stored_runs("grid", POINTS, run, check=[(0.0, 8)], store=tmp_path)
    monkeypatch.delenv(sr.RECOMPUTE_ENV)
    moved = lambda p: {**run(p), "gain": run(p)["gain"] * (1 + 1e-6 * (p == (0.5, 32)))}   # noqa: E731
    with pytest.raises(AssertionError, match=r"(?s)run \(0\.5, 32\).*\['gain'\].*MINIBATCH_RECOMPUTE=1"):
        sr.stored_runs("grid", POINTS, moved, check=[(0.0, 8), (0.5, 32)], store=tmp_path)
    # a last-bit difference (another CPU's exp) is not a change
    close = lambda p: {**run(p), "gain": run(p)["gain"] * (1 + 1e-13)}  # noqa: E731
    sr.stored_runs("grid", POINTS, close, check=POINTS, store=tmp_path)


def test_stale_or_missing_files_and_bad_checks_are_refused(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="MINIBATCH_RECOMPUTE=1"):
        sr.stored_runs("none", POINTS, run, check=[POINTS[0]], store=tmp_path)
    monkeypatch.setenv(sr.RECOMPUTE_ENV, "1")
    sr.stored_runs("grid", POINTS, run, check=[POINTS[0]], store=tmp_path)
    monkeypatch.delenv(sr.RECOMPUTE_ENV)
    with pytest.raises(ValueError, match=r"other points.*missing \[\(1\.0, 8\)\]"):
        sr.stored_runs("grid", POINTS + [(1.0, 8)], run, check=[POINTS[0]], store=tmp_path)
    with pytest.raises(ValueError, match="check must name"):
        sr.stored_runs("grid", POINTS, run, check=[], store=tmp_path)
    with pytest.raises(ValueError, match="check must name"):
        sr.stored_runs("grid", POINTS, run, check=[(9.0, 9)], store=tmp_path)
    with pytest.raises(ValueError, match="repeat"):
        sr.stored_runs("grid", POINTS + POINTS[:1], run, check=[POINTS[0]], store=tmp_path)


def test_differences_name_the_field_and_treat_nan_as_equal():
    assert sr.differences({"a": [1.0, float("nan")]}, {"a": [1.0, float("nan")]}) == []
    assert sr.differences({"a": [1, 2]}, {"a": [1, 3]}) == ["['a'][1]: 2 stored, 3 now"]
    assert sr.differences({"a": 1}, {"b": 1}) == ["the result: fields ['a'] stored, ['b'] now"]
    assert sr.differences([1, 2], [1]) == ["the result: 2 items stored, 1 now"]
    assert sr.differences(True, 1.0) != []


@pytest.mark.parametrize("path", sorted(sr.STORE.glob("*.json")), ids=lambda p: p.stem)
def test_each_stored_file_is_one_named_sweep_that_a_chapter_reads(path):
    data = json.loads(path.read_text())
    assert data["name"] == path.stem and data["runs"]
    points = [json.dumps(p) for p, _ in data["runs"]]
    assert len(set(points)) == len(points)
    chapters = sr.STORE.parents[2] / "chapters"
    sources = ["".join(c["source"]) for nb in chapters.glob("*.ipynb")
               for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    assert any(f'stored_runs("{path.stem}"' in s for s in sources), f"no chapter reads {path.name}: remove it"
