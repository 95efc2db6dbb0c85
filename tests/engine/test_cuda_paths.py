"""CUDA graphs for decode and asynchronous swap: the switches and the bucket rule on
any machine; the exactness checks on CUDA (``pytest -m cuda``, ``make gpu-check``)."""
from __future__ import annotations

import pytest
import torch

from minibatch_engine import build_model
from minibatch_engine.config import EngineConfig
from minibatch_engine.core.engine import Engine
from minibatch_engine.kv import HostKVPool, KVPool, SwapSpace
from minibatch_engine.model import reference_generate
from minibatch_engine.model.config import TINY
from minibatch_engine.runner.cuda_graphs import DecodeGraphs, graph_batch_sizes
from minibatch_engine.sampling.params import SamplingParams


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 8]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(65)[-1] == 72


def test_cuda_graphs_switch_is_validated_and_ignored_off_cuda(tiny32):
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    eng = Engine(tiny32, max_num_seqs=4, max_model_len=64, cuda_graphs=True)
    assert eng.runner.graphs is None            # CPU: every step runs eagerly
    with pytest.raises(ValueError, match="CUDA graphs need a model on CUDA"):
        DecodeGraphs(tiny32, eng.runner.kv_pool, eng.runner.attention, 4, 64, 0)


def _prompts():
    return [list(range(3 + i, 20 + 3 * i)) for i in range(6)]


@pytest.mark.cuda
@pytest.mark.parametrize("max_num_seqs", [3, 6])
def test_cuda_graphs_give_the_same_tokens(tiny64, max_num_seqs):
    """Decode through graphs (buckets padded with null-block rows) equals eager
    decode and the CPU reference, token for token (float64)."""
    pytest.importorskip("triton")
    gpu = build_model("tiny", device="cuda", dtype="float64")
    outs = {}
    for graphs in (True, False):
        eng = Engine(gpu, max_num_seqs=max_num_seqs, max_model_len=128, attention_backend="triton",
                     cuda_graphs=graphs)
        reqs = [eng.add_request(p, SamplingParams(max_tokens=20 + 3 * i, ignore_eos=True))
                for i, p in enumerate(_prompts())]
        eng.run()
        outs[graphs] = [r.output_token_ids for r in reqs]
        if graphs:
            assert eng.runner.graphs is not None and eng.runner.graphs.replays > 0
            assert set(eng.runner.graphs.graphs) <= set(graph_batch_sizes(max_num_seqs))
    assert outs[True] == outs[False]
    assert outs[True] == [reference_generate(tiny64, p, 20 + 3 * i) for i, p in enumerate(_prompts())]


@pytest.mark.cuda
def test_async_swap_lands_before_blocks_are_reused():
    """Swap out, overwrite the freed GPU blocks at once (as the next step would),
    swap back into other blocks: the data is intact, and the host pool is pinned."""
    torch.manual_seed(0)
    pool = KVPool(TINY.num_layers, 32, 16, TINY.num_kv_heads, TINY.head_dim, torch.float32, "cuda")
    pool.kv.normal_()
    swap, host = SwapSpace(8, pool.bytes_per_block), HostKVPool(TINY, 8, 16, torch.float32, "cuda")
    assert host.host.is_pinned()
    blocks, back = [3, 7, 1, 20], [30, 2, 11, 5]
    original = pool.kv[:, :, blocks].clone()
    host.swap_out(pool, blocks, swap.swap_out("r", len(blocks)))
    pool.kv[:, :, blocks] = -1.0                 # reused right away by the compute stream
    host.swap_in(pool, swap.swap_in("r"), back)
    assert torch.equal(pool.kv[:, :, back], original)
    assert swap.num_free_blocks == 8


def test_cpu_swap_round_trip():
    pool = KVPool(TINY.num_layers, 8, 4, TINY.num_kv_heads, TINY.head_dim, torch.float64, "cpu")
    pool.kv.normal_()
    swap, host = SwapSpace(4, pool.bytes_per_block), HostKVPool(TINY, 4, 4, torch.float64)
    original = pool.kv[:, :, [1, 5]].clone()
    host.swap_out(pool, [1, 5], swap.swap_out("r", 2))
    pool.kv[:, :, [1, 5]] = 0
    host.swap_in(pool, swap.swap_in("r"), [6, 0])
    assert torch.equal(pool.kv[:, :, [6, 0]], original)
