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
from minibatch_engine.runner.prepack import (num_packed_layers, packed_from_rows, packing_rows, prepack_available,
                                             prepack_linear_weights, unpack_linear_weights)

needs_onednn = pytest.mark.skipif(not prepack_available(), reason="no oneDNN in this torch build")


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
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(prepack.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a),
                        raising=False)
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
