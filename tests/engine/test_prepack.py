"""Prepacked CPU linear weights (runner/prepack.py) and the KV pool's memory (kv/pool.py)."""
import copy
import mmap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minibatch_engine import Engine, SamplingParams
from minibatch_engine.kv.pool import KVPool
from minibatch_engine.model import build_model
from minibatch_engine.runner import prepack
from minibatch_engine.attention.cpu_kernel import cpu_kernel_or_none
from minibatch_engine.runner.prepack import (num_packed_layers, pack, packed_from_rows, packing_kind, packing_rows,
                                             prepack_available, prepack_linear_weights, unpack_linear_weights)

needs_onednn = pytest.mark.skipif(not prepack_available(), reason="no packed path here (no oneDNN, no C++ kernels)")
needs_kernel = pytest.mark.skipif(cpu_kernel_or_none() is None, reason="the C++ CPU kernels do not build here")


@needs_kernel
@pytest.mark.parametrize("rows,k,n,bias", [(1, 7, 5, True), (3, 256, 512, False), (8, 64, 48, False),
                                           (9, 100, 97, True), (70, 33, 200, True), (130, 96, 130, False),
                                           (0, 8, 8, True)])
def test_panel_kernel_equals_f_linear(rows, k, n, bias):
    """Any row count (whole micro-kernel blocks and a tail, one and several row
    chunks), any width (a last panel of fewer than 48 columns), with and
    without bias, against float64."""
    g = torch.Generator().manual_seed(rows + k + n)
    w, x, b = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    kernel = cpu_kernel_or_none()
    out = kernel.panel_linear(x, kernel.pack_panels(w), n, b if bias else torch.empty(0))
    assert out.shape == (rows, n) and out.dtype == torch.float32
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


@needs_kernel
def test_panel_kernel_takes_strided_rows_and_any_batch():
    """Rows with a stride (a slice of a wider tensor) and transposed input are
    read correctly; each row's result is bit-identical whatever rows share the call."""
    g = torch.Generator().manual_seed(1)
    kernel = cpu_kernel_or_none()
    w = torch.randn(300, 64, generator=g)
    panels = kernel.pack_panels(w)
    wide = torch.randn(50, 128, generator=g)
    for x in (wide[:, :64], wide[:, :64].t().contiguous().t()):
        torch.testing.assert_close(kernel.panel_linear(x, panels, 300, torch.empty(0)), x @ w.t())
    x = wide[:, :64].contiguous()
    full = kernel.panel_linear(x, panels, 300, torch.empty(0))
    assert all(torch.equal(full[i:i + 1], kernel.panel_linear(x[i:i + 1], panels, 300, torch.empty(0)))
               for i in range(50))
    assert torch.equal(full[7:30], kernel.panel_linear(x[7:30], panels, 300, torch.empty(0)))


@needs_kernel
def test_panel_kernel_refuses_what_it_cannot_read():
    kernel = cpu_kernel_or_none()
    panels = kernel.pack_panels(torch.randn(10, 8))
    with pytest.raises(RuntimeError, match="panels must come from pack_panels"):
        kernel.panel_linear(torch.randn(2, 9), panels, 10, torch.empty(0))
    with pytest.raises(RuntimeError, match="float32"):
        kernel.panel_linear(torch.randn(2, 8, dtype=torch.float64), panels, 10, torch.empty(0))
    with pytest.raises(RuntimeError, match="bias must be"):
        kernel.panel_linear(torch.randn(2, 8), panels, 10, torch.empty(3))
    with pytest.raises(RuntimeError, match="float32"):
        kernel.pack_panels(torch.randn(10, 8, dtype=torch.float64))


def test_packing_kind_follows_dtype_and_kernel(monkeypatch):
    kind = packing_kind(torch.float32)
    assert kind == ("panels" if cpu_kernel_or_none() is not None else "onednn" if prepack._onednn_available()
                    else None)
    assert packing_kind(torch.float64) is None
    monkeypatch.setattr(prepack, "cpu_kernel_or_none", lambda: None)   # no compiler: oneDNN's layout
    assert packing_kind(torch.float32) == ("onednn" if prepack._onednn_available() else None)
    if prepack._onednn_available():
        w, x = torch.randn(20, 16), torch.randn(3, 2, 16)             # a 3-D input
        torch.testing.assert_close(pack(w)(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no packed path"):
        pack(torch.randn(4, 4, dtype=torch.float64))


@needs_onednn
@torch.no_grad()
def test_packed_linear_equals_f_linear_and_follows_the_weight():
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(48, 80, bias=True)
    assert prepack_linear_weights(layer, only_where_faster=False) == 1
    x = torch.randn(7, 48, generator=g)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.weight.mul_(-2)                      # changed in place: the next call repacks
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.weight = nn.Parameter(torch.randn(80, 48, generator=g))   # replaced: repacks too
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(layer)                # no opaque oneDNN tensor inside the module
    torch.testing.assert_close(twin(x), layer(x))
    assert set(layer.state_dict()) == {"weight", "bias"}
    unpack_linear_weights(layer)
    assert "forward" not in layer.__dict__


@needs_onednn
def test_packing_is_skipped_where_it_does_not_apply():
    layer = nn.Linear(8, 4).double()
    prepack_linear_weights(layer)
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))   # float64: plain F.linear
    y = layer.float()(x.float())               # with autograd on: plain F.linear, gradients flow
    y.sum().backward()
    assert layer.weight.grad is not None


@needs_onednn
def test_engine_tokens_are_the_same_with_and_without_packing():
    model = build_model("tiny", device="cpu", dtype="float32")
    prompts = [list(range(5 + i, 40 + 3 * i)) for i in range(4)]

    def run(pack):
        eng = Engine(model, max_num_seqs=4)
        unpack_linear_weights(model)
        if pack:
            assert prepack_linear_weights(model, only_where_faster=False) == num_packed_layers(model) > 0
        reqs = [eng.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        eng.run()
        return [r.output_token_ids for r in reqs]
    assert run(True) == run(False)


@needs_onednn
def test_packing_only_where_it_measures_faster(monkeypatch):
    """By default the model's layers are packed from the smallest row count at
    which packing measured faster for the model as a whole, at that count and
    every larger one; each weight shape is timed once and remembered."""
    monkeypatch.setattr(prepack, "_TIMES", {})
    threads = torch.get_num_threads()
    wide, narrow = nn.Linear(64, 96), nn.Linear(32, 16)
    model = nn.Sequential(wide, narrow, nn.Linear(64, 96))          # two layers of one shape
    times = prepack.linear_times(wide)
    assert sorted(times) == list(prepack.ROWS) and all(a > 0 and b > 0 for a, b in times.values())
    assert list(prepack._TIMES) == [(64, 96, torch.float32, threads)]
    assert prepack.linear_times(nn.Linear(64, 96)) == times                # remembered, not re-timed

    def pretend(wide_packed, narrow_packed):       # packed seconds per row count; plain is 1.0
        prepack._TIMES[(64, 96, torch.float32, threads)] = {m: (1.0, wide_packed[m]) for m in prepack.ROWS}
        prepack._TIMES[(32, 16, torch.float32, threads)] = {m: (1.0, narrow_packed[m]) for m in prepack.ROWS}
    same = lambda v: {m: v for m in prepack.ROWS}  # noqa: E731
    pretend(same(0.5), same(2.5))                  # wins on two layers, loses more on one: 3.0 vs 3.5
    assert packing_rows(model) is None and prepack_linear_weights(model) == 0
    pretend(same(0.5), same(1.9))                  # 3.0 vs 2.9: not by 5%
    assert packing_rows(model) is None
    slow_single_row = {1: 1.7, 2: 0.9, 4: 0.8, 16: 0.8, 64: 0.9}
    pretend(slow_single_row, slow_single_row)      # this machine's shape: loses at 1 row only
    assert packing_rows(model) == 2
    pretend({**slow_single_row, 4: 0.97}, {**slow_single_row, 4: 0.97})    # under 5% at 4, not slower
    assert packing_rows(model) == 2
    pretend(slow_single_row, slow_single_row)
    assert prepack_linear_weights(model) == 3 == num_packed_layers(model) and packed_from_rows(model) == 2
    unpack_linear_weights(model)
    pretend({**slow_single_row, 4: 1.2}, slow_single_row)     # 3.2 vs 3.0 at 4 rows: from 16 on
    assert packing_rows(model) == 16
    assert num_packed_layers(model) == 0 and packed_from_rows(model) is None
    assert prepack_linear_weights(model.double(), only_where_faster=False) == 3     # forced: every layer
    assert packed_from_rows(model) == 1
    assert packing_rows(model) is None                 # float64: never (oneDNN has no float64 kernels)


@needs_onednn
def test_a_step_below_the_packing_rows_takes_the_plain_path(monkeypatch):
    layer = nn.Linear(32, 48)
    assert prepack_linear_weights(layer, only_where_faster=False) == 1
    layer.packed_from_rows = 4
    calls = []
    real = prepack.pack

    def counting_pack(weight):
        multiply = real(weight)
        return lambda *a: calls.append(1) or multiply(*a)
    monkeypatch.setattr(prepack, "pack", counting_pack)
    with torch.no_grad():
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert len(calls) == 2                            # the 4- and 9-row inputs


def test_large_pools_are_zero_and_writable():
    p = KVPool(2, 1024, 16, 2, 64, torch.float32, "cpu")     # 32 MiB: the mmap path
    assert p.kv.is_contiguous() and p.kv.shape == (2, 2, 1025, 16, 2, 64)
    assert not p.kv.any()
    k, v = p.layer(1)
    k[5] = 1.0
    assert p.kv.sum() == 2 * 64
    assert p.kv.data_ptr() % 64 == 0        # aligned for vector loads (a page, with mmap)


def test_pool_falls_back_to_torch_zeros(monkeypatch):
    def no_mmap(*args, **kwargs):
        raise OSError("no anonymous memory here")
    monkeypatch.setattr(mmap, "mmap", no_mmap)
    p = KVPool(2, 1024, 16, 2, 64, torch.float64, "cpu")
    assert p.kv.dtype == torch.float64 and not p.kv.any()
    small = KVPool(1, 2, 4, 1, 8, torch.float32, "cpu")       # small pools never take the mmap path
    assert small.kv.shape == (1, 2, 3, 4, 1, 8) and not small.kv.any()


@needs_kernel
def test_the_engines_packed_path_takes_any_leading_dims():
    """``pack(w)`` runs a 3-D input through the panel kernel as rows."""
    assert packing_kind(torch.float32) == "panels"
    g = torch.Generator().manual_seed(2)
    w, x, b = torch.randn(20, 16, generator=g), torch.randn(3, 2, 16, generator=g), torch.randn(20, generator=g)
    torch.testing.assert_close(pack(w)(x, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_linear_path_times_times_every_path():
    from minibatch_engine.book.linear_paths import PATHS, linear_path_times
    times = linear_path_times([(20, 16), (48, 8)], rows=(1, 9), rounds=1, calls=1)
    assert sorted(times) == [1, 9] and all(set(t) == set(PATHS) and min(t.values()) > 0 for t in times.values())
