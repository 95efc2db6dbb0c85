"""bench against this CPU's limit (issue 27): the machine's rates are measured
once and cached, and a run's steps are set against the time they would take at
those rates."""
import json

import pytest
import torch

from minibatch_engine import machine_limit
from minibatch_engine.bench import format_report, run_bench
from minibatch_engine.model import get_preset


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "machine_limit.json"
    monkeypatch.setattr(machine_limit, "CACHE", path)
    return path


def test_rates_are_measured_once_and_cached(cache, monkeypatch):
    tiny = get_preset("tiny")
    first = machine_limit.machine_rates(tiny)
    assert first.flops_per_s > 1e8 and first.bytes_per_s > 1e8
    assert len(json.loads(cache.read_text())) == 1
    monkeypatch.setattr(machine_limit, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    assert machine_limit.machine_rates(tiny) == first


def test_bench_reports_the_share_of_this_cpus_limit(cache):
    summary, _ = run_bench("continuous", "uniform", num_requests=16, max_batch=16, seed=0, progress=False)
    frac = summary["machine_limit_fraction"]
    assert 0 < frac < 1.5 and summary["machine_limit_seconds"] > 0     # a measured rate is not a hard bound
    assert 0 < summary["machine_large_batch_limit_fraction"] < 1.5
    assert "of this CPU's limit" in format_report(summary)


def test_the_limit_is_the_roofline_at_the_measured_rates():
    """A step's limit is the larger of its FLOPs and its bytes at the machine's rates:
    halving the matmul rate doubles a compute-bound step's limit."""
    from minibatch_engine.trace import LaneRecord, StepRecord, Trace
    trace = Trace()
    trace.append(StepRecord(step=0, lanes=[LaneRecord("a", 0, "prefill", 512, 0)], batch_id=None,
                            computed_tokens=512, useful_tokens=512, prefill_tokens=512, decode_tokens=0,
                            num_scheduled=1, sampled_tokens=1, kv_reserved_bytes=0, kv_used_bytes=0,
                            kv_capacity_bytes=1, wall_start=0.0, wall_end=1.0, forward_s=1.0, sample_s=0.0))
    tiny = get_preset("tiny")
    fast = machine_limit.limit_of_run(trace, tiny, machine_limit.Rates(1e12, 1e15))
    slow = machine_limit.limit_of_run(trace, tiny, machine_limit.Rates(5e11, 1e15))
    assert slow["limit_seconds"] == pytest.approx(2 * fast["limit_seconds"])
    assert fast["limit_fraction"] == pytest.approx(fast["limit_seconds"])        # one second of wall time
