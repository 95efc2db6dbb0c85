"""``bench --vs-openvino``: token agreement, the clear error without OpenVINO, and
(with the ``openvino`` extra installed) one short run's report and the IR cache.
The benchmark's timings are not tested."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from minibatch_engine.entrypoints.cli import main
from minibatch_engine.harness.vs_openvino import first_difference, token_agreement

HAVE_OPENVINO = all(importlib.util.find_spec(m) is not None for m in ("openvino_genai", "optimum"))
needs_openvino = pytest.mark.skipif(not HAVE_OPENVINO, reason="OpenVINO GenAI and optimum-intel are not "
                                    "installed (the optional extra: pip install 'minibatch-engine[openvino]')")


def test_token_agreement_counts_identical_requests():
    a = [[1, 2, 3], [4, 5], [6], []]
    b = [[1, 2, 3], [4, 6], [6, 7], []]
    assert token_agreement(a, a) == 4
    assert token_agreement(a, b) == 2
    assert token_agreement([(1, 2)], [[1, 2]]) == 1          # a tuple and a list of the same tokens agree
    with pytest.raises(ValueError, match="as many requests"):
        token_agreement(a, b[:3])
    assert [first_difference(x, y) for x, y in zip(a, b)] == [None, 1, 1, None]


def test_missing_openvino_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "openvino_genai", None)     # import fails
    assert main(["bench", "--vs-openvino", "--no-progress"]) == 2
    assert "minibatch-engine[openvino]" in capsys.readouterr().err


def test_size_without_vs_openvino_is_refused(capsys):
    assert main(["bench", "--size", "125m", "--no-progress"]) == 2
    assert "--vs-openvino" in capsys.readouterr().err


@needs_openvino
def test_report_fields_agreement_and_ir_cache(two_layer_checkpoint, tmp_path):
    from minibatch_engine.harness.vs_openvino import compare, export_openvino, format_comparison
    s = compare(two_layer_checkpoint, num_requests=4, batch=4, rounds=1, threads=2, cache_dir=tmp_path,
                log=lambda *a: None)
    for key in ("systems", "engine_vs_openvino_per_round", "engine_vs_openvino_median", "requests_token_equal",
                "output_tokens", "openvino_genai", "exported_now", "load_average_at_end"):
        assert key in s
    assert set(s["systems"]) == {"openvino", "engine"}
    assert all(len(r["seconds"]) == 1 and r["tokens_per_second"] > 0 for r in s["systems"].values())
    assert s["exported_now"] is True
    # fp32 weights and KV, greedy, fixed lengths: the same tokens on every request
    assert s["requests_token_equal"] == 4, s["first_difference_positions"]
    assert "token agreement: 4/4" in format_comparison(s)
    assert s["others"] == {} and s["skipped"] == {}
    assert s["openvino_settings"].startswith("ContinuousBatchingPipeline")    # run in a process of its own
    # one untimed round of the whole workload first; the load follower's changes, per timed round
    assert s["warmup_rounds"] == 1 and "after 1 untimed" in format_comparison(s)
    assert len(s["engine_thread_changes_per_round"]) == 1
    xml = tmp_path / s["ir"].rsplit("/", 1)[-1] / "openvino_model.xml"
    before = xml.stat().st_mtime_ns
    ir, exported = export_openvino(two_layer_checkpoint, tmp_path, log=lambda *a: None)
    assert not exported and str(ir) == s["ir"] and xml.stat().st_mtime_ns == before


def test_a_prepared_system_is_built_before_its_timer_starts(monkeypatch):
    """The engine's build (KV cache, thread count) stays out of its timed run,
    as OpenVINO's pipeline, built once, does."""
    from minibatch_engine.harness import rounds
    events = []
    clock = iter(range(100))

    def perf_counter():
        events.append("clock")
        return float(next(clock))

    monkeypatch.setattr(rounds.time, "perf_counter", perf_counter)

    def prepare():
        events.append("build")
        return lambda: events.append("run") or [[1]]

    res = rounds.timed_rounds({"a": None}, 2, 10, log=lambda *_: None, prepare={"a": prepare})
    assert events == ["build", "clock", "run", "clock"] * 2
    assert res["a"].seconds == [1.0, 1.0] and res["a"].tokens == [[1]]


def test_warmup_rounds_run_every_system_untimed_before_the_timed_rounds(monkeypatch):
    """A warm-up round runs each system's whole workload (built fresh, as in a
    timed round) and records nothing; the timed rounds record only their own."""
    from minibatch_engine.harness import rounds
    events = []
    clock = iter(range(100))

    def perf_counter():
        events.append("clock")
        return float(next(clock))

    monkeypatch.setattr(rounds.time, "perf_counter", perf_counter)
    runs = {"a": lambda: events.append("a") or [[1]], "b": None}
    prepare = {"b": lambda: events.append("build b") or (lambda: events.append("b") or [[2]])}
    res = rounds.timed_rounds(runs, 1, 10, log=lambda *_: None, prepare=prepare, warmup_rounds=1)
    warm = events[:events.index("b") + 1]
    assert [e for e in warm if e != "clock"] == ["a", "build b", "b"]
    assert res["a"].seconds == [1.0] and res["b"].seconds == [1.0]
    assert res["a"].tokens == [[1]] and res["b"].tokens == [[2]]


@needs_openvino
def test_also_adds_systems_to_the_rounds_and_skips_missing_ones(two_layer_checkpoint, tmp_path, monkeypatch):
    """``--also``: another engine joins the same rounds, its ratio and token
    agreement with the engine reported; one that cannot run is skipped, saying why."""
    from minibatch_engine.harness import vs_openvino
    real = vs_openvino.start_other

    def prepare(name, *args, **kwargs):
        if name == "ctranslate2":
            raise vs_openvino.Unavailable("not here")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(vs_openvino, "start_other", prepare)
    s = vs_openvino.compare(two_layer_checkpoint, num_requests=4, batch=4, rounds=2, threads=2,
                            cache_dir=tmp_path, also=("transformers", "ctranslate2"), log=lambda *a: None)
    assert set(s["systems"]) == {"openvino", "engine", "transformers"}
    assert len(s["systems"]["transformers"]["seconds"]) == 2
    hf = s["others"]["transformers"]
    assert hf["requests_token_equal_engine"] == 4 and len(hf["engine_vs_per_round"]) == 2
    assert s["skipped"] == {"ctranslate2": "not here"}
    text = vs_openvino.format_comparison(s)
    assert "engine / transformers" in text and "ctranslate2: skipped (not here)" in text
    with pytest.raises(ValueError, match="--also takes"):
        vs_openvino.compare(two_layer_checkpoint, cache_dir=tmp_path, also=("vllm",))
