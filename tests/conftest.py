import pytest
import torch

from minibatch_engine.model import build_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_modifyitems(config, items):
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
