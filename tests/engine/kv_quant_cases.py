"""Random ragged batches over a quantized pool (fp8 / int8), shared by the
quantized-cache tests of every backend."""
import torch

from minibatch_engine.attention import get_attention_backend
from minibatch_engine.kv.quant import QuantizedSlots, dequantize, kv_format, quantize


def quantized_cache(values: torch.Tensor, kv_cache_dtype: str, static: bool = False) -> QuantizedSlots:
    """``values`` ``[num_slots, Hkv, D]`` stored in ``kv_cache_dtype``: scales per
    (slot, head), or static per head (``static=True``, from the values' own range)."""
    fmt = kv_format(kv_cache_dtype)
    if static:
        scale = (values.abs().amax(dim=(0, 2)).float() / fmt.qmax).clamp_min(1e-30)
        data, _ = quantize(values, fmt, scale)
    else:
        data, scale = quantize(values, fmt)
    return QuantizedSlots(data, scale.contiguous(), fmt)


def clone(c: QuantizedSlots) -> QuantizedSlots:
    return QuantizedSlots(c.data.clone(), c.scale.clone(), c.fmt)


def run_quantized(backend, case, kv_cache_dtype, static=False, device="cpu"):
    """The backend's output over the case's pool stored in ``kv_cache_dtype``, and the
    two caches after its write."""
    kc = quantized_cache(case["k_cache"], kv_cache_dtype, static)
    vc = quantized_cache(case["v_cache"], kv_cache_dtype, static)
    kc, vc = (QuantizedSlots(c.data.to(device), c.scale.to(device), c.fmt) for c in (kc, vc))
    meta = backend.build_metadata(case["query_lens"], case["seq_lens"], case["block_tables"],
                                  case["block_size"], device)
    q, k, v = (case[n].to(device) for n in "qkv")
    return backend.forward(q, k, v, meta, kc, vc), kc, vc


def assert_quantized_matches_reference(backend, case, kv_cache_dtype, static=False, device="cpu"):
    """Same output as the reference over the same quantized cache, and the same bytes
    and scales written (every backend shares the one quantizer)."""
    out, kc, vc = run_quantized(backend, case, kv_cache_dtype, static, device)
    ref, rkc, rvc = run_quantized(get_attention_backend("reference"), case, kv_cache_dtype, static)
    tol = dict(rtol=0, atol=1e-12) if case["q"].dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu(), ref, **tol)
    for mine, theirs in ((kc, rkc), (vc, rvc)):
        assert torch.equal(mine.data.cpu().view(torch.uint8), theirs.data.view(torch.uint8))
        assert torch.equal(mine.scale.cpu(), theirs.scale)


def dequantized(c: QuantizedSlots, dtype) -> torch.Tensor:
    return dequantize(c.data, c.slot_scales(), dtype)


def every_fp8_code(backend, device="cpu"):
    """(reference output, ``backend``'s output) over a cache holding each of the 254
    finite float8 e4m3 codes (subnormals, both zeros, +-448) with scales 1 and 2^-3,
    read by two decodes (one over all 127 slots, one over 60)."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    data = codes.view(torch.float8_e4m3fn).view(-1, 1, 2).repeat(1, 1, 8)     # 127 slots, 1 head, D 16
    scale = torch.where(torch.arange(127) % 2 == 0, 1.0, 0.125)[:, None].float()
    q = torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.01
    outs = []
    for b, dev in ((get_attention_backend("reference"), "cpu"), (backend, device)):
        k, v = (QuantizedSlots(data.clone().to(dev), scale.clone().to(dev), kv_format("fp8")) for _ in "kv")
        meta = b.build_metadata([1, 1], [127, 60], [list(range(127)), list(range(60))], 1, dev)
        new = torch.zeros(2, 1, 16, dtype=torch.float64, device=dev)   # unused: the cache holds every key
        outs.append(b.attend(q.to(dev), new, new, meta, k, v).cpu())
    return outs
