"""The explorables (minibatch_engine/book/explorables): their HTML is
deterministic, their checks are the chapter's own numbers, and every formula
the browser computes agrees with its Python original (run through Node.js
where it is installed; the browser check compares them again on the site)."""
import json
import re
import shutil
import subprocess
from importlib import resources

import numpy as np
import pytest

from minibatch_engine.book.efficiency import eta_run
from minibatch_engine.book.explorables import Explorable, eta_explorer
from minibatch_engine.book.explorables.base import rounded

NODE = shutil.which("node")


def _js(*names):
    return "\n".join(resources.files("minibatch_engine.book.explorables").joinpath("static", n)
                     .read_text() for n in names)


def run_js(body: str, *scripts: str):
    """Evaluate ``body`` (an expression) after the given static scripts, in Node."""
    prelude = "globalThis.window = globalThis;\n" + _js("base.js", *scripts)
    out = subprocess.run([NODE, "-e", prelude + f"\nprocess.stdout.write(JSON.stringify({body}));"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _lengths(sigma, n=40):
    rng = np.random.default_rng(int(sigma * 100))
    return [(int(p), int(g)) for p, g in zip(rng.integers(1, 60, n), rng.integers(1, 200, n))]


def test_the_html_is_deterministic_and_named():
    a = eta_explorer(_lengths, [0.0, 0.5, 1.0, 2.0], checks=[(1.0, 4)])._repr_html_()
    b = eta_explorer(_lengths, [0.0, 0.5, 1.0, 2.0], checks=[(1.0, 4)])._repr_html_()
    assert a == b
    assert 'id="mbe-ch2-eta"' in a and "http" not in re.sub(r"http://www.w3.org/2000/svg", "", a)
    assert "</script>" not in a.split('class="mbe-data">')[1].split("</script>")[0]


def test_eta_checks_are_eta_run():
    sigmas = [0.0, 0.5, 1.0, 2.0]
    e = eta_explorer(_lengths, sigmas, checks=[(1.0, 4), (2.0, 64), (0.0, 1)])
    for chk, (s, b) in zip(e.checks, [(1.0, 4), (2.0, 64), (0.0, 1)]):
        assert chk["set"] == {"sigma": sigmas.index(s), "batch": b}
        assert chk["expect"]["eta"] == pytest.approx(eta_run(_lengths(s), b), rel=1e-6)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="sigma 0.3 is not on the grid"):
        eta_explorer(_lengths, [0.0, 1.0], checks=[(0.3, 4)])
    with pytest.raises(ValueError, match="explorable name"):
        Explorable("Bad Name", "eta", {})
    with pytest.raises(ValueError, match="no static/nope.js"):
        Explorable("ok", "nope", {})


def test_rounded_keeps_six_significant_digits():
    assert rounded({"a": [1 / 3, 2], "b": float("nan")}) == {"a": [0.333333, 2], "b": None}


@pytest.mark.skipif(NODE is None, reason="needs node")
@pytest.mark.parametrize("batch", [1, 3, 16, 64])
def test_the_browser_eta_is_eta_run(batch):
    lengths = _lengths(1.0, n=50)
    p, g = [x for x, _ in lengths], [y for _, y in lengths]
    got = run_js(f"MBE.etaRun({p}, {g}, {batch})", "eta.js")
    assert got["eta"] == pytest.approx(eta_run(lengths, batch), rel=1e-12)


@pytest.mark.skipif(NODE is None, reason="needs node")
def test_the_browser_percentile_is_numpys():
    x = sorted(np.random.default_rng(0).exponential(1.0, 37).round(4).tolist())
    ps = [0, 1, 25, 50, 90, 99, 99.9, 100]
    got = run_js(f"{ps}.map(function (p) {{ return MBE.percentile({x}, p); }})")
    assert got == pytest.approx([float(np.percentile(x, p)) for p in ps], rel=1e-12)
