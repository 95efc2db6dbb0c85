"""Chapter 10's helpers in minibatch_engine.book: the K/V read rates (kv_reads) and
gpu_check.json read back (gpu_check_report), which must say plainly when no GPU
has run the CUDA code."""
from __future__ import annotations

import json

from minibatch_engine import Engine, EngineConfig, SamplingParams
from minibatch_engine.book import gpu_check_report as report
from minibatch_engine.book import kv_reads, prompt_blocks


def test_the_synthetic_step_reads_what_it_says(tiny32):
    cfg = tiny32.config
    step = kv_reads.synthetic_decode_step(cfg, scattered=True, seqs=4, context=32, layers=2, block_size=8)
    assert step.bytes_per_layer == 4 * 32 * kv_reads.kv_bytes_per_token(cfg)
    tables = step.inputs[3].block_tables
    assert sorted(tables.flatten().tolist()) == list(range(4 * 32 // 8))    # every block once
    assert kv_reads.layer_seconds(step) > 0
    rates = kv_reads.layout_rates(cfg, rounds=2, seqs=4, context=32, layers=2, block_size=8)
    assert rates["consecutive"] > 0 and rates["shuffled"] > 0 and rates["layers"] == 2
    assert rates["pool_mib"] == step.bytes_per_layer * 2 / 2**20
    loops = kv_reads.loop_rates(cfg, rounds=2, seqs=4, context=32, layers=2, block_size=8)
    assert loops["simd"] > 0 and loops["plain"] > 0


def test_a_prompt_as_one_prompt_and_as_one_token_rows_is_the_same_attention(tiny32):
    """prompt_blocks hands the kernel one prompt, then its queries as rows of one
    token over the same keys: the same outputs to float32 rounding, both timed."""
    import torch
    from minibatch_engine.attention.cpu_kernel import load_cpu_kernel
    kernel = load_cpu_kernel()
    case = prompt_blocks.prompt_case(tiny32.config, 40, block_size=8)
    rows = case["rows"]
    assert rows[7].tolist() == list(range(1, 41)) and rows[8].tolist() == list(range(41))
    a, b = kernel.paged_attention(*case["prompt"]), kernel.paged_attention(*rows)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert case["pairs"] == 40 * 41 // 2 * tiny32.config.num_heads
    got = prompt_blocks.prompt_paths(tiny32.config, 40, rounds=2)
    assert got["ns_prompt"] > 0 and got["ns_rows"] > 0 and len(got["ratios"]) == 2
    assert got["max_abs_diff"] < 1e-4


def test_the_decode_read_rate_counts_decode_steps_only(tiny32):
    eng = Engine(tiny32, EngineConfig(max_num_seqs=4, max_model_len=64, attention_backend="cpp"))
    for i in range(3):
        eng.add_request(list(range(3, 10 + i)), SamplingParams(max_tokens=4, ignore_eos=True))
    assert kv_reads.decode_read_rate(eng) > 0
    assert kv_reads.stream_rate(mib=4, reps=1) > 0
    assert kv_reads.last_level_cache_bytes() >= 0


def test_without_gpu_check_json_the_cuda_code_is_untested(tmp_path):
    none = report.read_gpu_check(tmp_path / "gpu_check.json")
    assert none is None
    assert "untested on a GPU" in report.gpu_status(none)
    assert "untested on a GPU" in report.gpu_status_short(none)


def test_a_gpu_check_json_is_read_back(tmp_path):
    data = {"machine": {"gpu": "NVIDIA H200", "driver": "1", "torch": "t", "triton": "x",
                        "date_utc": "2026-01-01 00:00", "git_commit": "0123456789abcdef"},
            "cuda_tests": {"passed": 12, "failures": 0},
            "triton_check": {"dtype": "torch.bfloat16", "max_abs_error": 0.01},
            "decode": [{"batch": 1, "cuda_graphs": True, "median_step_ms": 2.0, "output_tokens_per_s": 500.0,
                        "achieved_GBps": 1000.0, "hbm_roofline_fraction": 0.2},
                       {"batch": 256, "cuda_graphs": False, "error": "out of memory"}]}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(data))
    got = report.read_gpu_check(path)
    assert "NVIDIA H200" in report.gpu_status(got) and "12 CUDA tests passed" in report.gpu_status(got)
    assert "untested" not in report.gpu_status_short(got)
    lines = report.gpu_check_lines(got)
    assert lines[0].startswith("NVIDIA H200") and "0123456789" in lines[0]
    assert lines[-1] == "decode at batch 256 failed: out of memory"
    assert report.decode_rows(got) == [[1, "on", 2.0, 500.0, 1000.0, 0.2]]
    assert len(report.DECODE_COLUMNS) == 6
