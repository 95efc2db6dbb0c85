"""Chapter 14's helpers (minibatch_engine/book/big_models.py) and its explorable."""
import math
import shutil

import pytest

from minibatch_engine.book import big_models as bm
from minibatch_engine.book.explorables import deploy_explorer
from minibatch_engine.model.config import get_preset

from .test_explorables import run_js


def test_bytes_per_step_is_the_ring_and_the_hand_over():
    m = get_preset("llama-3-70b")
    message = 64 * m.hidden_size * 2
    got = bm.bytes_per_step("llama-3-70b", 8, 2, 64)
    assert math.isclose(got["all-reduce MB"] * 1e6, 2 * 40 * message * 2 * 7 / 8)
    assert math.isclose(got["hand-over MB"] * 1e6, 2 * message / 8)
    assert bm.bytes_per_step("llama-3-70b", 1, 1, 64) == {"all-reduce MB": 0.0, "hand-over MB": 0.0}


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 4), (4, 16), (8, 3)])
def test_the_gpipe_schedule_idles_as_gpipe_says(pp, m):
    sim, formula = bm.gpipe_check(pp, m)
    assert math.isclose(sim, formula) and math.isclose(formula, (pp - 1) / (m + pp - 1))


def test_the_send_recv_fit_is_close_on_large_messages():
    rows = {(r["placement"], r["size"]): r for r in bm.send_recv_errors()}
    assert sum(r["rows"] for r in rows.values()) > 1000
    for placement in ("within a node", "across nodes"):
        assert rows[placement, "8 MiB and more"]["median error"] < 0.05


def test_pipeline_stages_beat_tp16_across_nodes_and_hold_more_kv():
    pp = bm.layout_row("llama-3-70b", "H100-SXM", 8, 2)
    tp = bm.layout_row("llama-3-70b", "H100-SXM", 16, 1)
    one = bm.layout_row("llama-3-70b", "H100-SXM", 8, 1)
    assert pp["decode b64 ms"] < tp["decode b64 ms"] and pp["prefill 2048 ms"] < tp["prefill 2048 ms"]
    assert pp["max seqs"] > one["max seqs"] and pp["decode b1 ms"] >= one["decode b1 ms"]


GRID = {("m", "H100-SXM", 4, 1, 1.0): {"ok": True, "replicas": 2, "gpus": 8, "ttft_ms": 300.0,
                                       "tpot_ms": 30.0, "cost_per_mtok": 3.5},
        ("m", "H100-SXM", 4, 1, 2.5): {"ok": False, "why": "weights do not fit"}}


def test_deploy_checks_are_the_grid_and_unknown_settings_are_named():
    e = deploy_explorer(GRID, ("m", "H100-SXM", 4, 1, 1.0), list(GRID), {"m": (500, 50)})
    assert e.checks[0]["expect"] == {"gpus": 8, "ttft_ms": 300.0, "tpot_ms": 30.0, "cost_per_mtok": 3.5}
    assert e.checks[1]["expect"] == {} and 'id="mbe-ch14-deploy"' in e._repr_html_()
    with pytest.raises(ValueError, match="not on the grid"):
        deploy_explorer(GRID, ("m", "H200", 4, 1, 1.0), [], {"m": (500, 50)})


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js not installed")
def test_the_browser_finds_every_grid_key():
    keys = [list(k) for k in GRID]
    got = run_js("[" + ",".join(f"MBE.deployKey({k[0]!r}, {k[1]!r}, {k[2]}, {k[3]}, {k[4]})"
                                 for k in keys) + "]", "deploy.js")
    assert got == ["|".join(map(str, k)) for k in GRID]
