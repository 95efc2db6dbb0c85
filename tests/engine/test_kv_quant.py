"""The quantized KV cache (kv_cache_dtype "fp8" / "int8"): round-trip error
bounds, every CPU backend against the reference over the same quantized cache,
block copies, swaps and prefix sharing with quantized blocks, the draft model's
cache, and the block count a byte budget buys."""
import pytest
import torch

from minibatch_engine import LLM, Engine, SamplingParams, SpeculativeConfig, reference_generate
from minibatch_engine.attention import get_attention_backend
from minibatch_engine.attention.cpu_kernel import cpu_kernel_available
from minibatch_engine.kv import HostKVPool, KVPool
from minibatch_engine.kv.quant import QuantizedSlots, dequantize, kv_bytes_per_token, kv_format, quantize
from minibatch_engine.model.reference import full_forward_logits

from ..conftest import assert_all_memory_back
from .attention_cases import random_batch
from .kv_quant_cases import assert_quantized_matches_reference, dequantized, every_fp8_code, run_quantized

QUANT = ["fp8", "int8"]


# --- the formats ------------------------------------------------------------------------
def _rows(seed=0):
    """Rows with a wide range of magnitudes, an outlier per row, and an all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, 32, generator=gen, dtype=torch.float64)
    x *= torch.logspace(-4, 3, 64, dtype=torch.float64)[:, None, None]
    x[:, :, 5] *= 20
    x[3] = 0
    return x


def test_int8_round_trip_is_within_half_a_step():
    x = _rows()
    stored, scale = quantize(x, kv_format("int8"))
    assert stored.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == x.shape[:2]
    err = (dequantize(stored, scale, torch.float64) - x).abs()
    step = scale.double()[..., None]
    assert (err <= step / 2 * (1 + 1e-6)).all()
    assert stored.abs().max() == 127                       # each row's largest value uses the full range
    assert (dequantize(stored, scale, torch.float64)[3] == 0).all()


def test_fp8_round_trip_keeps_three_mantissa_bits():
    x = _rows(1)
    stored, scale = quantize(x, kv_format("fp8"))
    assert stored.dtype == torch.float8_e4m3fn
    back = dequantize(stored, scale, torch.float64)
    err = (back - x).abs()
    # normal values: half an ulp of a 3-bit mantissa (2^-4 relative); subnormals (below
    # 2^-6 of the scale unit): half the subnormal step, 2^-10 of the unit
    bound = torch.maximum(x.abs() * 2.0 ** -4, scale.double()[..., None] * 2.0 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert torch.isfinite(back).all() and stored.float().abs().max() == 448


@pytest.mark.parametrize("kv", QUANT)
def test_static_scales_clip_what_exceeds_them(kv):
    fmt = kv_format(kv)
    x = torch.tensor([[[1.0, -3.0, 0.5]]], dtype=torch.float64)
    stored, _ = quantize(x, fmt, torch.tensor([1.0 / fmt.qmax]))   # range 1.0
    back = dequantize(stored, torch.tensor([1.0 / fmt.qmax]), torch.float64)
    torch.testing.assert_close(back[..., :2], torch.tensor([[[1.0, -1.0]]], dtype=torch.float64),
                               rtol=1e-6, atol=0)      # -3 clipped to the range
    assert abs(float(back[0, 0, 2]) - 0.5) < 1 / fmt.qmax


def test_unknown_dtype_and_granularity_are_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_format("fp16")
    with pytest.raises(ValueError, match="kv_cache_scale"):
        KVPool(1, 2, 4, 1, 8, torch.float32, "cpu", "int8", "per_block")
    with pytest.raises(ValueError, match="static_scales of shape"):
        KVPool(1, 2, 4, 1, 8, torch.float32, "cpu", "int8", "per_head")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b", kv_cache_dtype="fp4")


# --- every backend over the same quantized cache ---------------------------------------
BACKENDS = ["reference", "sdpa"] + (["cpp"] if cpu_kernel_available() else [])


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backends_equal_the_reference_over_a_quantized_cache(name, kv, dtype):
    """Decodes, prefills, chunks after cached context; block sizes 1, 16 and 32; GQA;
    per-(token, head) and static scales: same output, same bytes and scales written."""
    backend = get_attention_backend(name)
    gen = torch.Generator().manual_seed(3)
    for kind in ("decode", "prefill", "mixed"):
        for block_size, (h, hkv), d in [(1, (2, 2), 16), (16, (4, 2), 64), (32, (4, 1), 24)]:
            case = random_batch(gen, kind, block_size, h, hkv, d, dtype, num_seqs=4, max_len=40)
            assert_quantized_matches_reference(backend, case, kv)
            assert_quantized_matches_reference(backend, case, kv, static=True)


@pytest.mark.parametrize("name", [b for b in BACKENDS if b != "reference"])
def test_every_fp8_code_is_decoded_as_torch_decodes_it(name):
    """A cache holding each of the 254 finite float8 e4m3 codes (subnormals, zeros of
    both signs, 448), scales 1 and 2^-3: the backend's output equals the reference's."""
    ref, out = every_fp8_code(get_attention_backend(name))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kv", QUANT)
def test_the_reference_attends_over_the_dequantized_cache(kv):
    """What "reads a quantized cache" means: the same attention as over a float pool
    holding the dequantized values, the step's own new K/V included."""
    gen = torch.Generator().manual_seed(4)
    case = random_batch(gen, "mixed", 4, 4, 2, 16, torch.float64)
    out, kc, vc = run_quantized(get_attention_backend("reference"), case, kv)
    ref = get_attention_backend("reference")
    meta = ref.build_metadata(case["query_lens"], case["seq_lens"], case["block_tables"], 4)
    kd, vd = dequantized(kc, torch.float64), dequantized(vc, torch.float64)
    expect = ref.attend(case["q"], case["k"], case["v"], meta, kd, vd)
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-12)
    # and the step's own K/V were stored rounded, not as computed
    written = kd[meta.slot_mapping]
    assert not torch.equal(written, case["k"])
    torch.testing.assert_close(written, case["k"], rtol=0.07, atol=0.02)


# --- the pool: copies, swaps, bytes ----------------------------------------------------
@pytest.mark.parametrize("kv", QUANT)
def test_block_copies_and_swaps_move_bytes_and_scales(kv):
    pool = KVPool(2, 6, 4, 2, 8, torch.float64, "cpu", kv)
    gen = torch.Generator().manual_seed(0)
    for i in range(2):
        for c in pool.layer(i):
            c.write(torch.arange(24), torch.randn(24, 2, 8, generator=gen, dtype=torch.float64))
    before = [t.clone() for t in pool.block_tensors()]
    pool.copy_blocks([1, 2], [4, 5])                           # copy-on-write
    for t, b in zip(pool.block_tensors(), before):
        assert torch.equal(t[:, :, [4, 5]].view(torch.uint8), b[:, :, [1, 2]].view(torch.uint8))
    host = HostKVPool(pool_config(pool), 3, 4, torch.float64, "cpu", kv)
    host.swap_out(pool, [0, 1], [2, 0])
    pool.kv.view(torch.uint8).zero_()
    pool.scales.zero_()
    host.swap_in(pool, [2, 0], [3, 0])
    for t, b in zip(pool.block_tensors(), before):
        assert torch.equal(t[:, :, [3, 0]].view(torch.uint8), b[:, :, [0, 1]].view(torch.uint8))


def pool_config(pool):
    from minibatch_engine.model.config import ModelConfig
    return ModelConfig(family="llama", vocab_size=8, hidden_size=pool.num_kv_heads * pool.head_dim,
                       num_layers=pool.num_layers, num_heads=pool.num_kv_heads, num_kv_heads=pool.num_kv_heads,
                       intermediate_size=8, max_position=64)


def test_bytes_per_token_count_the_scales():
    pool = KVPool(4, 2, 16, 2, 64, torch.float32, "cpu", "fp8")
    assert pool.bytes_per_token == 2 * 4 * 2 * (64 + 4)
    assert pool.kv.element_size() + pool.scales.element_size() / 64 == pool.bytes_per_token / (2 * 4 * 2 * 64)
    static = KVPool(4, 2, 16, 2, 64, torch.float32, "cpu", "int8", "per_head", torch.ones(4, 2, 2))
    assert static.bytes_per_token == 2 * 4 * 2 * 64


@pytest.mark.parametrize("model_dtype, elem", [(torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("kv", ["fp8", "fp8_e4m3", "int8"])
def test_a_byte_budget_holds_the_blocks_the_formula_says(model_dtype, elem, kv):
    """At a fixed budget: blocks = budget // (block_size x 2 x layers x kv_heads x
    (head_dim + 4)) against budget // (block_size x 2 x layers x kv_heads x head_dim
    x element): a little under 2x float16's (head_dim / (head_dim + 4) of it), a
    little under 4x float32's."""
    budget, bs = 8_000_000_000, 16
    for sim_model in ("llama-3-8b", "llama-3.2-1b"):
        base = Engine(None, sim_gpu="H100-SXM", sim_model=sim_model, kv_budget_bytes=budget, block_size=bs)
        quant = Engine(None, sim_gpu="H100-SXM", sim_model=sim_model, kv_budget_bytes=budget, block_size=bs,
                       kv_cache_dtype=kv)
        mc = base.model_config
        per_tok = 2 * mc.num_layers * mc.num_kv_heads * int(base.cost_model.kv_replication)
        assert base.kv_cache.num_blocks == budget // (bs * per_tok * mc.head_dim * 2)       # bfloat16 there
        assert quant.kv_cache.num_blocks == budget // (bs * per_tok * (mc.head_dim + 4))
        ratio = quant.kv_cache.num_blocks / base.kv_cache.num_blocks
        assert abs(ratio - 2 * mc.head_dim / (mc.head_dim + 4)) < 0.01
    mc = get_tiny()
    assert kv_bytes_per_token(mc, model_dtype, kv) * elem * mc.head_dim == \
        kv_bytes_per_token(mc, model_dtype) * (mc.head_dim + 4)


def get_tiny():
    from minibatch_engine.model import get_preset
    return get_preset("tiny")


# --- the engine: every path through the cache ------------------------------------------
PROMPTS = [[7, 7, 1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], [7, 7, 1, 2, 3, 4, 5, 6, 8],
           list(range(40, 70)), [3] * 21]


def _check(engine, model, kv, max_tokens=10):
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in PROMPTS]
    engine.run()
    for r, p in zip(reqs, PROMPTS):
        assert engine.samples_of(r.request_id)[0].output_token_ids == reference_generate(model, p, max_tokens, kv)
    assert_all_memory_back(engine)


@pytest.mark.parametrize("kv", QUANT)
@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_prefix_sharing_and_chunks_give_the_quantized_lone_recompute(tiny64, kv, backend):
    """A pool too small for the batch (preemption by swap and by recompute), shared
    prefixes, chunked prefill with a tiny token budget: the tokens of the lone
    recompute through the same quantized cache."""
    for mode in ("swap", "recompute"):
        engine = Engine(tiny64, max_num_seqs=4, max_model_len=48, block_size=4, num_kv_blocks=16,
                        watermark=0.0, max_num_batched_tokens=8, preemption_mode=mode,
                        swap_space_bytes=64 * 4 * 1088, attention_backend=backend, kv_cache_dtype=kv)
        assert engine.runner.kv_pool.quantized
        _check(engine, tiny64, kv)
        assert any(step.preempted for step in engine.trace.steps), "the test meant to preempt"


@pytest.mark.parametrize("kv", QUANT)
def test_forks_copy_on_write_quantized_blocks(tiny64, kv):
    engine = Engine(tiny64, max_num_seqs=4, block_size=4, kv_cache_dtype=kv)
    prompt = [5, 6, 7, 8, 9, 10]                            # a partly filled last block: copied on write
    r = engine.add_request(prompt, SamplingParams(max_tokens=6, n=3, ignore_eos=True))
    engine.run()
    want = reference_generate(tiny64, prompt, 6, kv)
    assert [s.output_token_ids for s in engine.samples_of(r.request_id)] == [want] * 3


@pytest.mark.parametrize("kv", QUANT)
def test_static_batching_on_the_reserved_cache(tiny64, kv):
    engine = Engine(tiny64, scheduler="static", max_num_seqs=2, max_model_len=48, kv_cache_dtype=kv,
                    attention_backend="sdpa")
    _check(engine, tiny64, kv)


@pytest.mark.parametrize("kv", QUANT)
def test_the_draft_models_cache_is_quantized_too(tiny64, kv):
    spec = SpeculativeConfig("draft_model", 3, draft_model=tiny64)
    engine = Engine(tiny64, max_num_seqs=4, block_size=4, speculative=spec, kv_cache_dtype=kv)
    assert engine.runner.proposer.kv_pool.quantized
    _check(engine, tiny64, kv, max_tokens=12)


def test_llm_takes_kv_cache_dtype(tiny32):
    out = LLM(tiny32, kv_cache_dtype="int8").generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny32, kv_cache_dtype="int4")


def test_the_quantized_reference_differs_from_the_float_one_only_slightly(tiny64):
    """The lone recompute through a quantized cache is a different model, slightly:
    its logits are close to the float ones, not equal."""
    ids = list(range(30, 60))
    base = full_forward_logits(tiny64, ids)
    for kv, tol in (("int8", 0.02), ("fp8", 0.2)):
        q = full_forward_logits(tiny64, ids, kv)
        assert not torch.equal(q, base)
        assert (q - base).abs().max() < tol


# --- what the user sees: bench, simulate, /metrics ------------------------------------
def test_simulate_and_bench_show_the_doubled_block_count(capsys):
    from minibatch_engine.entrypoints.cli import main
    blocks = {}
    for kv in ("auto", "fp8", "int8"):
        assert main(["simulate", "--num-requests", "4", "--kv-budget", str(8 * 2**30), "--kv-cache-dtype", kv,
                     "--no-progress", "--json", "/dev/null"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("cache"))
        blocks[kv] = int(line.split(" in ")[1].split(" blocks")[0].replace(",", ""))
        assert ("bytes per token" in line) == (kv != "auto")
    # llama-3-8b, bfloat16 there: head_dim 128, so 2 x 128 / 132 of the blocks
    assert blocks["fp8"] == blocks["int8"] == 8 * 2**30 // (16 * 2 * 32 * 8 * 132)
    assert blocks["auto"] == 8 * 2**30 // (16 * 2 * 32 * 8 * 256)
    assert main(["bench", "--num-requests", "2", "--kv-cache-dtype", "int8", "--no-progress",
                 "--max-model-len", "512", "--attention-backend", "sdpa"]) == 0
    assert "int8: 1,088 bytes per token" in capsys.readouterr().out     # tiny: 2 x 4 x 2 x (64 + 4)


def test_metrics_carry_the_cache_config_info():
    pytest.importorskip("prometheus_client")
    from minibatch_engine.entrypoints.server.metrics import PrometheusStatLogger, parse_metrics
    for kv in ("auto", "fp8"):
        engine = Engine(None, sim_gpu="H100-SXM", sim_model="llama-3-8b", kv_budget_bytes=2**30, kv_cache_dtype=kv)
        logger = PrometheusStatLogger("m")
        logger.set_cache_config(engine)
        m = parse_metrics(logger.exposition().decode())
        key = next(k for k in m if k.startswith("minibatch:cache_config_info"))
        assert m[key] == 1
        assert f'cache_dtype="{kv}"' in key and f'num_gpu_blocks="{engine.kv_cache.num_blocks}"' in key


# --- the accuracy measures -------------------------------------------------------------
def test_accuracy_measures_are_exact_for_auto_and_follow_the_engine(tiny64):
    from minibatch_engine.model import kv_quant_accuracy as qa
    ids, calib = list(range(3, 67)), list(range(100, 164))
    rows = qa.teacher_forced_metrics(tiny64, ids, calib, [("auto", "per_token_head"), ("int8", "per_head")])
    assert (rows[0].mean_kl, rows[0].top1_agreement, rows[0].perplexity) == (0.0, 1.0, rows[0].float_perplexity)
    assert rows[1].mean_kl > 0 and rows[1].max_kl >= rows[1].mean_kl
    for gran in ("per_head", "per_tensor"):
        s = qa.calibrate_kv_scales(tiny64, calib, "fp8", gran)
        assert s.shape == (4, 2, 2) and (s > 0).all()
        assert (s[..., 0] == s[..., 1]).all() == (gran == "per_tensor")
    # the measuring loop writes and reads the cache as the engine does: the same tokens
    for kv in ("auto", "int8", "fp8"):
        assert qa.greedy_tokens(tiny64, [5, 6, 7], 8, kv) == reference_generate(tiny64, [5, 6, 7], 8, kv)
    agree = qa.greedy_agreement(tiny64, [[5, 6, 7]], 6, calib, [("auto", "per_token_head")])[0]
    assert agree.token_agreement == 1.0 and agree.identical_runs == 1 and agree.mean_first_divergence == 6
    prof = qa.kv_error_profile(tiny64, ids, calib)
    assert len(prof) == 8 and all(0 < r["per_token_head"] < 0.02 and r["peak_to_rms"] > 1 for r in prof)
    assert all(r["channel_peak_to_mean"] >= 1 for r in prof)


def test_under_load_a_quantized_cache_holds_more_and_preempts_less():
    from minibatch_engine.book.kv_capacity import DETERMINISTIC, kv_dtypes_under_load
    budget = 2048 * 16 * 24                                   # 24 blocks of bfloat16 tiny
    auto, fp8, int8 = kv_dtypes_under_load(budget, model="tiny", num_requests=8, max_batch=8,
                                           attention_backend="sdpa", max_model_len=400)
    assert auto["kv_blocks"] == budget // (16 * 2048) and fp8["kv_blocks"] == budget // (16 * 1088)
    assert all(fp8[k] == int8[k] for k in DETERMINISTIC if k != "kv_cache_dtype")
    assert fp8["peak_running"] >= auto["peak_running"] and fp8["preemptions"] <= auto["preemptions"]
    assert auto["output_tokens"] == fp8["output_tokens"] and auto["preemptions"] > 0


def test_serve_kv_cache_dtype_reaches_the_served_engine(monkeypatch):
    """``serve --kv-cache-dtype int8``: /metrics reports the int8 cache, and a greedy
    completion equals the offline LLM's with the same cache."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("prometheus_client")
    import minibatch_engine.entrypoints.server as server_pkg
    from minibatch_engine.entrypoints.cli import main
    from minibatch_engine.entrypoints.server import ServerThread
    from .server_fixtures import metrics, post
    apps = []
    monkeypatch.setattr(server_pkg, "serve", lambda app, **kw: apps.append(app))    # build, don't listen
    assert main(["serve", "--model", "tiny", "--device", "cpu", "--attention-backend", "sdpa",
                 "--max-model-len", "256", "--kv-cache-dtype", "int8"]) == 0
    prompt, n = "The quantized cache", 16
    with ServerThread(apps[0]) as s:
        info = next(k for k in metrics(s.url) if k.startswith("minibatch:cache_config_info"))
        status, body, _ = post(s.url, {"model": "tiny", "prompt": prompt, "max_tokens": n,
                                       "temperature": 0, "ignore_eos": True})
    assert 'cache_dtype="int8"' in info
    assert status == 200
    offline = LLM("tiny", device="cpu", attention_backend="sdpa", max_model_len=256, kv_cache_dtype="int8")
    want = offline.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
    assert body["choices"][0]["text"] == want.outputs[0].text
