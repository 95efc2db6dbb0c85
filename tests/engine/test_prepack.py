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
from minibatch_engine.runner.prepack import (num_packed_layers, packing_pays, prepack_available,
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
    """By default the model's layers are packed only if packing measured faster for
    the model as a whole; each weight shape is timed once and remembered."""
    monkeypatch.setattr(prepack, "_TIMES", {})
    threads = torch.get_num_threads()
    wide, narrow = nn.Linear(64, 96), nn.Linear(32, 16)
    model = nn.Sequential(wide, narrow, nn.Linear(64, 96))          # two layers of one shape
    plain, packed = prepack.linear_times(wide)
    assert plain > 0 and packed > 0 and list(prepack._TIMES) == [(64, 96, torch.float32, threads)]
    assert prepack.linear_times(nn.Linear(64, 96)) == (plain, packed)      # remembered, not re-timed
    prepack._TIMES[(64, 96, torch.float32, threads)] = (1.0, 0.5)          # pretend: packing wins here,
    prepack._TIMES[(32, 16, torch.float32, threads)] = (1.0, 2.5)          # loses more here: 3.0 vs 3.5
    assert not packing_pays(model) and prepack_linear_weights(model) == 0
    prepack._TIMES[(32, 16, torch.float32, threads)] = (1.0, 1.9)          # now 3.0 vs 2.9: not by 5%
    assert not packing_pays(model)
    prepack._TIMES[(32, 16, torch.float32, threads)] = (1.0, 1.0)          # 3.0 vs 2.0: packs all
    assert packing_pays(model) and prepack_linear_weights(model) == 3 == num_packed_layers(model)
    unpack_linear_weights(model)
    assert num_packed_layers(model) == 0
    assert prepack_linear_weights(model.double(), only_where_faster=False) == 3     # forced: every layer
    assert not packing_pays(model)                      # float64: never (oneDNN has no float64 kernels)


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
