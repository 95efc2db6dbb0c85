"""The model and its KV cache: cached decoding equals full recompute, and the
cache holds exactly the bytes the formula says."""
import pytest
import torch

from minibatch_engine.attention import AttentionMetadata
from minibatch_engine.kv import KVPool, ReservedKVCache
from minibatch_engine.model import Transformer, build_model, full_forward_logits, get_preset, reference_generate
from minibatch_engine.model.config import PRESETS, ModelConfig

from ..conftest import DEVICES


def cached_greedy(model, prompt, n, max_model_len=128):
    """Prefill once, then decode one token per step through a reserved cache."""
    cache = ReservedKVCache(model.config, 1, max_model_len, dtype=model.dtype)
    pool = KVPool.for_cache(cache, model.config, model.dtype, model.device)
    cache.allocate("r", len(prompt))
    dev = model.device
    meta = AttentionMetadata.build([len(prompt)], [len(prompt)], [cache.block_table("r")], cache.block_size, dev)
    logits = model(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev), meta, pool)
    out, length = [], len(prompt)
    for _ in range(n):
        tok = int(logits[0].argmax())
        out.append(tok)
        length += 1
        cache.allocate("r", length)
        meta = AttentionMetadata.build([1], [length], [cache.block_table("r")], cache.block_size, dev)
        logits = model(torch.tensor([tok], device=dev), torch.tensor([length - 1], device=dev), meta, pool)
    return out


@torch.no_grad()
@pytest.mark.parametrize("prompt", [[1], list(b"Hello, world"), list(range(40, 90))])
def test_cached_decoding_equals_full_recompute(tiny64, prompt):
    assert cached_greedy(tiny64, prompt, 24) == reference_generate(tiny64, prompt, 24)


@torch.no_grad()
def test_ragged_batch_logits_equal_each_sequence_alone(tiny64):
    """Three sequences with different cached lengths and new-token counts in one
    forward give the logits each gets alone."""
    torch.manual_seed(0)
    seqs = [torch.randint(0, 256, (n,)).tolist() for n in (7, 19, 30)]
    new = [7, 1, 5]   # a prefill, a decode, a chunk
    cache = ReservedKVCache(tiny64.config, 3, 64, dtype=torch.float64)
    pool = KVPool.for_cache(cache, tiny64.config, torch.float64, "cpu")
    ids, pos, ql, sl, bts = [], [], [], [], []
    for i, (s, q) in enumerate(zip(seqs, new)):
        rid = str(i)
        cache.allocate(rid, len(s))
        if len(s) > q:   # write the cached part first, alone
            m = AttentionMetadata.build([len(s) - q], [len(s) - q], [cache.block_table(rid)], 64)
            tiny64(torch.tensor(s[:-q]), torch.arange(len(s) - q), m, pool)
        ids += s[-q:]
        pos += range(len(s) - q, len(s))
        ql.append(q), sl.append(len(s)), bts.append(cache.block_table(rid))
    meta = AttentionMetadata.build(ql, sl, bts, 64)
    logits = tiny64(torch.tensor(ids), torch.tensor(pos), meta, pool)
    for i, s in enumerate(seqs):
        ref = full_forward_logits(tiny64, s)[-1]
        torch.testing.assert_close(logits[i], ref, rtol=0, atol=1e-10)


def test_kv_bytes_match_formula_and_allocation():
    cfg = get_preset("tiny")
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2), (torch.float64, 8)):
        cache = ReservedKVCache(cfg, num_rows=3, max_model_len=100, dtype=dtype)
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size
        assert cache.bytes_per_token == per_token == cfg.kv_bytes_per_token(size)
        # the runner's pool tensor really holds num_rows x max_model_len tokens (+ one null block)
        assert KVPool.for_cache(cache, cfg, dtype, "cpu").kv.numel() * size == per_token * 100 * 4
        assert cache.capacity_bytes == per_token * 100 * 3
        cache.allocate("a", 10)
        cache.allocate("b", 30)
        assert cache.reserved_bytes == 2 * 100 * per_token and cache.used_bytes == 0
        cache.mark_computed("a", None, 10)
        cache.mark_computed("b", None, 30)
        assert cache.used_bytes == 40 * per_token
        cache.free("a")
        assert cache.reserved_bytes == 100 * per_token and cache.free_rows == [0, 2]


def test_reserved_cache_refuses_when_full_or_too_long():
    cache = ReservedKVCache(get_preset("tiny"), num_rows=1, max_model_len=16)
    assert not cache.allocate("a", 17)
    assert cache.allocate("a", 16)
    assert not cache.allocate("b", 1)
    assert cache.num_used_blocks == 1


@pytest.mark.parametrize("name", sorted(n for n, c in PRESETS.items() if not c.is_moe))   # MoE: simulator only
def test_parameter_count_formula_matches_module(name):
    cfg = get_preset(name)
    if cfg.num_parameters() > 2e8:   # count big presets on the meta device
        with torch.device("meta"):
            model = Transformer(cfg)
    else:
        model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_published_shapes():
    assert get_preset("llama-2-7b").num_parameters() == pytest.approx(6.74e9, rel=0.01)
    assert get_preset("llama-3-8b").num_parameters() == pytest.approx(8.03e9, rel=0.01)
    # GQA: Llama-3-8B keeps 8 KV heads of 128 dims: 128 KiB per token in bf16
    assert get_preset("llama-3-8b").kv_bytes_per_token(2) == 131072
    assert get_preset("llama-2-7b").kv_bytes_per_token(2) == 524288


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_low_precision_dtypes_run(dtype):
    model = build_model("tiny", device="cpu", dtype=dtype)
    logits = full_forward_logits(model, list(b"dtype check"))
    assert logits.dtype == model.dtype and torch.isfinite(logits.float()).all()


def test_same_seed_same_weights_and_different_seed_different():
    a, b, c = build_model(seed=0, device="cpu"), build_model(seed=0, device="cpu"), build_model(seed=1, device="cpu")
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_config_validation():
    with pytest.raises(ValueError, match="family"):
        ModelConfig(family="bert", vocab_size=10, hidden_size=8, num_layers=1, num_heads=2,
                    num_kv_heads=2, intermediate_size=8, max_position=8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(family="llama", vocab_size=10, hidden_size=8, num_layers=1, num_heads=3,
                    num_kv_heads=2, intermediate_size=8, max_position=8)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("gpt-5")


def test_metadata_rejects_bad_lengths():
    with pytest.raises(ValueError):
        AttentionMetadata.build([2], [1])
    with pytest.raises(ValueError, match="needs 2 blocks"):
        AttentionMetadata.build([1], [5], [[0]], block_size=4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_matches_cpu(dtype):
    cpu = build_model("tiny", device="cpu", dtype="float64")
    gpu = build_model("tiny", device="cuda", dtype=dtype)
    prompt = list(b"on the GPU")
    ref = full_forward_logits(cpu, prompt)
    got = full_forward_logits(gpu, prompt).double().cpu()
    assert torch.allclose(got, ref, atol=5e-2 if dtype == "bfloat16" else 1e-3)
    if dtype == "float32":
        assert cached_greedy(gpu, prompt, 16) == reference_generate(cpu, prompt, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_every_tensor_on_the_model_device(device):
    """The pool and every tensor a step builds (ids, positions, attention
    metadata) live on the model's device: no hidden host round trip."""
    from minibatch_engine import LLM, SamplingParams
    llm = LLM("tiny", device=device, max_num_seqs=2)
    seen = []

    def spy(runner):
        prepare = runner.prepare_inputs

        def wrapped(sched):
            ids, pos, meta = prepare(sched)
            def tensors_in(obj, depth=0):
                if isinstance(obj, torch.Tensor):
                    return [obj]
                if isinstance(obj, (list, tuple)):
                    return [t for x in obj for t in tensors_in(x, depth)]
                if depth < 2 and hasattr(obj, "__dataclass_fields__"):
                    return [t for k in obj.__dataclass_fields__ if not k.startswith("_")
                            for t in tensors_in(getattr(obj, k), depth + 1)]
                return []
            tensors = [ids, pos, *tensors_in(meta)]
            seen.append({t.device.type for t in tensors})
            return ids, pos, meta
        runner.prepare_inputs = wrapped

    from minibatch_engine.core import engine as engine_module
    original = engine_module.ModelRunner.__init__

    def init(self, *a, **kw):
        original(self, *a, **kw)
        spy(self)
    engine_module.ModelRunner.__init__ = init
    try:
        llm.generate(["a", "bc"], SamplingParams(max_tokens=3), use_tqdm=False)
    finally:
        engine_module.ModelRunner.__init__ = original
    assert llm.engine.runner.kv_pool.kv.device.type == device
    assert len(seen) == 3 and all(devices == {device} for devices in seen)
