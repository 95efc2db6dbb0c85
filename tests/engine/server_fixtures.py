"""Fixtures shared by the HTTP server's test modules: one tiny server per module,
the official ``openai`` client on it, and the offline ``LLM`` with the same
options (the reference a served reply must equal). A module imports them by
name; it skips first when the serve extra or ``openai`` is missing."""
import pytest

from minibatch_engine import LLM
from minibatch_engine.server import ServerThread, make_app

OPTS = dict(device="cpu", attention_backend="sdpa", max_num_seqs=32, max_model_len=256)


@pytest.fixture(scope="module")
def server():
    with ServerThread(make_app("tiny", **OPTS)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny", **OPTS)
