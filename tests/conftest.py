"""Fixtures and helpers every test folder shares: ``tests/engine/`` (the
engine) and ``tests/repo/`` (the book, the site, the repository's files)."""
import os

import pytest
import torch

# `make unit` runs the tests in two worker processes (pytest-xdist, UNIT_JOBS):
# one thread each, set before the engine reads PyTorch's default, so that two
# workers on two cores never wait for each other's threads at a barrier.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from minibatch_engine import Engine, EngineConfig  # noqa: E402
from minibatch_engine.kv import PagedKVCache  # noqa: E402
from minibatch_engine.model import build_model  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SIM = dict(sim_gpu="H100-SXM", sim_model="llama-3-8b")     # Llama-3-8B on a simulated H100


def sim_engine(**options) -> Engine:
    """An engine with no model: the scheduler on the simulator's clock."""
    return Engine(None, EngineConfig(**{**SIM, **options}))


def assert_all_memory_back(engine) -> None:
    """The leak check: every KV block (and row) back, the block manager's
    invariants intact, the host swap space empty; and after one idle step
    (the runner hears of the last step's finished requests at the next step,
    as in vLLM V1), no state left in the runner: sampling generators, its copy
    of the tokens, the proposer's state and the draft model's cache."""
    kv = engine.kv_cache
    assert kv.num_used_blocks == 0 and kv.reserved_bytes == 0
    if isinstance(kv, PagedKVCache):
        kv.manager.check_invariants()
        assert not kv.manager.block_tables
    swap = getattr(engine.scheduler, "preemptor", None) and engine.scheduler.preemptor.swap_space
    if swap:
        assert swap.num_free_blocks == swap.num_blocks and not swap.tables
    assert not engine.has_unfinished()
    engine.step()
    runner = engine.runner
    assert not getattr(runner, "generators", None) and not getattr(runner, "token_ids", None)
    proposer = runner.proposer
    assert not getattr(proposer, "fed", None)
    draft = getattr(proposer, "kv_cache", None)
    if draft is not None:
        draft.manager.check_invariants()
        assert draft.manager.num_used_blocks == 0


def pytest_collection_modifyitems(config, items):
    # the files holding slow tests first (a stable sort keeps each file's order): in
    # `make tests`' one session their long tests start while short ones fill the
    # other worker, instead of one worker running them alone at the end
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)
    skip = pytest.mark.skip(reason="CUDA is not available")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny64():
    """The built-in tiny model in float64 on the CPU: exact comparisons."""
    return build_model("tiny", device="cpu", dtype="float64")


@pytest.fixture(scope="session")
def tiny32():
    return build_model("tiny", device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def two_layer_checkpoint(tmp_path_factory):
    """A seeded two-layer Llama saved as a Hugging Face checkpoint (the CPU
    engine comparisons' tests: OpenVINO, CTranslate2, llama.cpp, transformers)."""
    pytest.importorskip("transformers")
    from minibatch_engine.model.config import ModelConfig
    from minibatch_engine.model.hf_export import save_hf_checkpoint
    cfg = ModelConfig(family="llama", name="two-layer", vocab_size=256, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, intermediate_size=128, max_position=512)
    path = tmp_path_factory.mktemp("ckpt")
    save_hf_checkpoint(build_model(cfg, device="cpu", dtype="float32", seed=3), path)
    return path
