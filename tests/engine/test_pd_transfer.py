"""P/D disaggregation with vLLM's ``kv_transfer_params`` (issue 45, item 3),
in one process: a prefill server and a decode server (``--kv-transfer-config``)
driven as vLLM's P/D proxy drives them. Greedy tokens equal one replica's; the
decode replica computes one prompt token per request (the last, as vLLM);
both block pools end full; an unreachable prefill replica, a pin pulled twice,
a mismatched model and a pin past its timeout fail or free cleanly. The
two-process and vllm-router versions are in ``test_pd_serve.py``."""
import time

import pytest

pytest.importorskip("aiohttp")

from minibatch_engine.cluster.kv_transfer import PDConnector  # noqa: E402
from minibatch_engine.entrypoints.server import ServerThread, make_app  # noqa: E402
from minibatch_engine.entrypoints.server.kv_transfer import KVTransferConfig  # noqa: E402

from .server_fixtures import free_port, post  # noqa: E402

OPTS = dict(device="cpu", attention_backend="sdpa", max_num_seqs=8, max_model_len=256)
PROMPTS = [[(7 * i + 3 * k) % 250 + 1 for k in range(n)] for i, n in enumerate((40, 17, 5, 33))]


def pd_config(role, **extra):
    return {"kv_connector": "MinibatchConnector", "kv_role": role, **extra}


@pytest.fixture(scope="module")
def servers():
    one = ServerThread(make_app("tiny", **OPTS)).start()
    prefill = ServerThread(make_app("tiny", block_size=8, kv_transfer_config=pd_config(
        "kv_producer", kv_connector_extra_config={"pin_timeout_s": 2.0}), **OPTS)).start()
    decode = ServerThread(make_app("tiny", block_size=16, kv_transfer_config=pd_config("kv_consumer"),
                                   **OPTS)).start()
    yield one, prefill, decode
    for s in (one, prefill, decode):
        s.stop()


def proxy(prefill_url, decode_url, body):
    """vLLM's toy P/D proxy: prefill with max_tokens 1, then the original request
    with the prefill's kv_transfer_params. Returns (prefill reply, decode status, reply)."""
    first = dict(body, max_tokens=1, stream=False,
                 kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                     "remote_block_ids": None, "remote_host": None, "remote_port": None})
    status, p, _ = post(prefill_url, first)
    assert status == 200, p
    status, d, _ = post(decode_url, dict(body, kv_transfer_params=p["kv_transfer_params"]))
    return p, status, d


def stats(server):
    return server.call(server.llm.between_steps(lambda engine: server.llm.kv_connector.snapshot()))


def test_pd_tokens_equal_one_replica_and_decode_skips_the_prompt(servers):
    one, prefill, decode = servers
    before = stats(decode)
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        _, want, _ = post(one.url, body)
        p, status, got = proxy(prefill.url, decode.url, body)
        assert status == 200, got
        params = p["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt)
        assert len(params["remote_block_ids"]) == -(-len(prompt) // 8)      # the prefill's blocks of 8
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
    after = stats(decode)
    # the decode replica computed the last prompt token of each request, no other prompt token
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(PROMPTS)
    assert after["loaded_tokens"] - before["loaded_tokens"] == sum(len(p) - 1 for p in PROMPTS)
    assert after["tokens_computed"] - before["tokens_computed"] == 12 * len(PROMPTS)
    assert stats(prefill)["pins_held"] == 0
    for s in (prefill, decode):
        assert s.llm.engine.kv_cache.num_used_blocks == 0
        s.llm.engine.kv_cache.manager.check_invariants()
        assert not s.llm.engine.scheduler.received and not s.llm.engine.runner.inbox


def test_streamed_chat_through_the_pair(servers):
    one, prefill, decode = servers
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0}
    _, want, _ = post(one.url, body, path="/v1/chat/completions")
    first = dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    _, p, _ = post(prefill.url, first, path="/v1/chat/completions")
    _, got, _ = post(decode.url, dict(body, kv_transfer_params=p["kv_transfer_params"]), path="/v1/chat/completions")
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]


def test_a_pin_is_pulled_once_and_expires(servers):
    _, prefill, decode = servers
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    p, status, _ = proxy(prefill.url, decode.url, body)
    assert status == 200
    status, err, _ = post(decode.url, dict(body, kv_transfer_params=p["kv_transfer_params"]))   # pulled already
    assert status == 502 and "pulled already" in err["error"]["message"]
    assert err["error"]["param"] == "kv_transfer_params"
    # a prefill nobody pulls holds its blocks, and gives them back after pin_timeout_s (2 s)
    status, p, _ = post(prefill.url, dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200 and stats(prefill)["pins_held"] == 1
    assert prefill.llm.engine.kv_cache.num_used_blocks == len(p["kv_transfer_params"]["remote_block_ids"])
    deadline = time.monotonic() + 30
    while prefill.llm.engine.kv_cache.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.1)
    assert prefill.llm.engine.kv_cache.num_used_blocks == 0
    assert stats(prefill)["expired"] >= 1


def test_an_unreachable_prefill_replica_is_a_502(servers):
    _, _, decode = servers
    params = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "cmpl-x-0",
              "remote_host": "127.0.0.1", "remote_port": free_port()}
    t0 = time.monotonic()
    status, err, _ = post(decode.url, {"prompt": PROMPTS[1], "max_tokens": 4, "kv_transfer_params": params})
    assert status == 502 and "could not pull" in err["error"]["message"]
    assert time.monotonic() - t0 < 30
    assert decode.llm.engine.kv_cache.num_used_blocks == 0 and not decode.llm.engine.scheduler.received


def test_refusals_name_the_field(servers):
    one, prefill, decode = servers
    body = {"prompt": PROMPTS[2], "max_tokens": 1}
    for server, params, words in [
            (decode, {"do_remote_decode": True}, "kv_consumer"),
            (prefill, {"do_remote_prefill": True}, "kv_producer"),
            (decode, {"do_remote_prefill": True, "remote_host": "127.0.0.1"}, "remote_request_id")]:
        status, err, _ = post(server.url, dict(body, kv_transfer_params=params))
        assert status == 400 and words in err["error"]["message"], err
        assert err["error"]["param"].startswith("kv_transfer_params")
    status, err, _ = post(prefill.url, dict(body, stream=True, kv_transfer_params={"do_remote_decode": True}))
    assert status == 400 and "'stream': false" in err["error"]["message"]
    # a server without a connector ignores the parameters, as vLLM without a KV connector does
    status, _, _ = post(one.url, dict(body, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200
    # a prompt other than the one prefilled is refused (and the pin is gone: it was pulled)
    _, p, _ = post(prefill.url, dict(body, kv_transfer_params={"do_remote_decode": True}))
    status, err, _ = post(decode.url, {"prompt": PROMPTS[3], "max_tokens": 2,
                                       "kv_transfer_params": p["kv_transfer_params"]})
    assert status == 400 and "different prompt" in err["error"]["message"]
    assert prefill.llm.engine.kv_cache.num_used_blocks == 0


def test_a_mismatched_model_is_refused(servers):
    _, prefill, _ = servers
    with ServerThread(make_app("tiny", dtype="float64", kv_transfer_config=pd_config("kv_consumer"),
                               **OPTS)) as other:
        body = {"prompt": PROMPTS[2], "max_tokens": 3}
        _, p, _ = post(prefill.url, dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        status, err, _ = post(other.url, dict(body, kv_transfer_params=p["kv_transfer_params"]))
        assert status == 400 and "dtype is 'float32'" in err["error"]["message"], err
        assert other.llm.engine.kv_cache.num_used_blocks == 0


@pytest.mark.parametrize("bad, words", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "MinibatchConnector"),
    ({"kv_connector": "MinibatchConnector", "kv_role": "producer"}, "kv_role"),
    ({"kv_connector": "MinibatchConnector", "kv_role": "kv_both", "kv_buffer_size": 1}, "kv_buffer_size"),
    ({"kv_connector": "MinibatchConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"timeout": 1}}, "timeout"),
    ({"kv_connector": "MinibatchConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"pin_timeout_s": 0}}, "pin_timeout_s"),
    ({"kv_role": "kv_both"}, "kv_connector is required"),
    ("{not json", "not JSON"),
])
def test_config_refuses_by_name(bad, words):
    with pytest.raises(ValueError, match=words):
        KVTransferConfig.parse(bad)


def test_connector_needs_a_paged_float_cache():
    from minibatch_engine.entrypoints.async_llm import AsyncLLM
    with pytest.raises(ValueError, match="paged KV cache"):
        AsyncLLM("tiny", device="cpu", kv_layout="reserved", kv_connector=PDConnector())
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        AsyncLLM("tiny", device="cpu", kv_cache_dtype="int8", kv_connector=PDConnector())


def test_engine_level_pin_take_load_equals_a_lone_recompute():
    """Without HTTP: a producer engine pins a prompt's blocks (shared with a later
    request of the same prompt through the prefix cache), the connector reads
    and unpins them, a consumer engine loads them and decodes; greedy tokens
    equal a full recompute, and both block pools end full and consistent."""
    from minibatch_engine.core.engine import Engine
    from minibatch_engine.model.reference import reference_generate
    from minibatch_engine.model.registry import resolve_model
    from minibatch_engine.sampling.params import SamplingParams
    model = resolve_model("tiny", device="cpu", dtype="float32")
    prod, cons = PDConnector("kv_producer"), PDConnector("kv_consumer")
    pe = Engine(model, block_size=4, attention_backend="sdpa")
    ce = Engine(model, block_size=16, attention_backend="sdpa")
    prod.attach(pe)
    cons.attach(ce)
    prompt = PROMPTS[1]
    prod.on_add(pe, "p", {"pin": True})
    pe.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), request_id="p")
    pe.run()
    pin = prod.pinned("p")
    assert pin is not None and len(pin.block_ids) == -(-len(prompt) // 4)
    assert pe.kv_cache.num_used_blocks == len(pin.block_ids)
    pe.add_request(prompt, SamplingParams(max_tokens=2, temperature=0), request_id="again")   # shares the pin's blocks
    pe.run()
    assert pe.scheduler.requests["again"].num_cached_tokens == (len(prompt) - 1) // 4 * 4
    pin, kv = prod.take("p")
    assert prod.pinned("p") is None and pe.kv_cache.num_used_blocks == 0
    pe.kv_cache.manager.check_invariants()
    with pytest.raises(KeyError):
        prod.take("p")
    cons.on_add(ce, "d", {"load": kv[:, :, :len(prompt) - 1]})
    ce.add_request(prompt, SamplingParams(max_tokens=10, temperature=0), request_id="d")
    (done,) = ce.run()
    assert done.output_token_ids == reference_generate(model, prompt, 10)
    assert ce.runner.prompt_tokens_computed == 1 and ce.runner.tokens_computed == 10
    cons.on_end(ce, "d")
    assert ce.kv_cache.num_used_blocks == 0 and not ce.scheduler.received and not ce.runner.inbox
    ce.kv_cache.manager.check_invariants()


def test_an_aborted_prefill_pins_nothing():
    from minibatch_engine.core.engine import Engine
    from minibatch_engine.model.registry import resolve_model
    from minibatch_engine.sampling.params import SamplingParams
    conn = PDConnector("kv_producer")
    e = Engine(resolve_model("tiny", device="cpu"), attention_backend="sdpa")
    conn.attach(e)
    conn.on_add(e, "p", {"pin": True})
    e.add_request(PROMPTS[0], SamplingParams(max_tokens=1), request_id="p")
    e.abort("p")
    e.run()
    assert conn.pinned("p") is None and e.kv_cache.num_used_blocks == 0
