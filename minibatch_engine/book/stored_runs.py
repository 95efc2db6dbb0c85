"""A chapter's longest simulator sweeps, stored with the package and checked on every run.

The simulator is deterministic: the same code and the same inputs give the same
numbers. A sweep of dozens of simulated runs (chapter 3's spread x batch grid,
chapter 12's P/D sweep) can therefore be run once, stored, and read back, as
long as each run of the chapter proves the stored numbers are still what the
code gives. :func:`stored_runs` does both. It reads every run's result from
``stored/<name>.json`` beside this module, recomputes the runs the chapter
names in ``check`` (chosen in the chapter's cell, where the reader sees them: in
a grid, at least one per value of each swept parameter; along one parameter,
its two ends), and fails, naming the run and the field, if one differs from its
stored result. A change to the engine that
moves a simulated number therefore fails the chapter's test run (nbval) until
the sweep is stored again.

``MINIBATCH_RECOMPUTE=1`` (``make notebooks`` sets it) recomputes every run and
writes the file again; ``git diff`` then shows what moved. Floats are compared to
nine significant digits: far below any digit a chapter prints, and above the
last-bit differences one CPU's ``exp`` can have from another's.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Hashable, Sequence

STORE = Path(__file__).resolve().parent / "stored"
RECOMPUTE_ENV = "MINIBATCH_RECOMPUTE"
REL_TOL = 1e-9


def _key(point) -> Hashable:
    """A point as a dict key: JSON's lists back to tuples."""
    return tuple(_key(x) for x in point) if isinstance(point, (list, tuple)) else point


def _plain(value):
    """``value`` as JSON gives it back (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


def differences(stored, fresh, where: str = "") -> list[str]:
    """Where ``fresh`` differs from ``stored`` (floats to :data:`REL_TOL`)."""
    if isinstance(stored, dict) and isinstance(fresh, dict):
        if stored.keys() != fresh.keys():
            return [f"{where or 'the result'}: fields {sorted(stored)} stored, {sorted(fresh)} now"]
        return [d for k in stored for d in differences(stored[k], fresh[k], f"{where}[{k!r}]")]
    if isinstance(stored, list) and isinstance(fresh, list):
        if len(stored) != len(fresh):
            return [f"{where or 'the result'}: {len(stored)} items stored, {len(fresh)} now"]
        return [d for i, (a, b) in enumerate(zip(stored, fresh)) for d in differences(a, b, f"{where}[{i}]")]
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (stored, fresh))
    if numbers and float in (type(stored), type(fresh)):
        same = (math.isnan(stored) and math.isnan(fresh)) or math.isclose(
            stored, fresh, rel_tol=REL_TOL, abs_tol=1e-12)
    else:
        same = type(stored) is type(fresh) and stored == fresh
    return [] if same else [f"{where or 'the result'}: {stored!r} stored, {fresh!r} now"]


def stored_runs(name: str, points: Sequence, run: Callable[[Any], Any], check: Sequence,
                store: Path | None = None) -> dict:
    """``{point: run(point)}`` for every point of a sweep, read from the stored
    file ``name``; the points in ``check`` are run here and must give their
    stored results. ``run`` returns JSON data (numbers, strings, lists, dicts);
    a point is a number, a string, None or a tuple of those."""
    path = (store or STORE) / f"{name}.json"
    points = [_key(p) for p in points]
    check = [_key(p) for p in check]
    if len(set(points)) != len(points):
        raise ValueError(f"{name}: the points repeat one another")
    if not check or not set(check) <= set(points):
        raise ValueError(f"{name}: check must name one point or more of the sweep, got {check}")
    recomputed = {}
    if os.environ.get(RECOMPUTE_ENV) == "1":
        results = recomputed = {p: _plain(run(p)) for p in points}
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps([list(p) if isinstance(p, tuple) else p, results[p]])
                 for p in points]      # one run a line: a diff shows which runs moved
        path.write_text(f'{{"name": {json.dumps(name)}, "runs": [\n' + ",\n".join(lines) + "\n]}\n")
    if not path.exists():
        raise FileNotFoundError(f"{name}: no stored results at {path}; run the chapter with "
                                f"{RECOMPUTE_ENV}=1 to compute and store them")
    stored = {_key(p): value for p, value in json.loads(path.read_text())["runs"]}
    if set(stored) != set(points):
        raise ValueError(f"{name}: {path.name} holds other points than the chapter asks for "
                         f"(missing {sorted(set(points) - set(stored), key=repr)}, extra "
                         f"{sorted(set(stored) - set(points), key=repr)}); run it with "
                         f"{RECOMPUTE_ENV}=1 to store the sweep again")
    for p in check:
        found = differences(stored[p], recomputed[p] if p in recomputed else _plain(run(p)))
        if found:
            raise AssertionError(
                f"{name}: run {p} no longer gives its stored result ({path}):\n  "
                + "\n  ".join(found[:5]) + f"\nIf the change is meant, run the chapter with "
                f"{RECOMPUTE_ENV}=1 to store the sweep again, and check its prose.")
    shown = path.relative_to(STORE.parents[2]) if path.is_relative_to(STORE) else path.name
    print(f"{len(points)} runs read from {shown}; the {len(check)} rerun here "
          f"equal their stored results")
    return {p: stored[p] for p in points}
