"""``minibatch-engine route`` in front of ``serve`` replicas on loopback: the
same greedy text as the offline ``LLM``, streaming, the policies' choices
(round-robin in turn, prefix affinity within its load guard), a backend that
is down, disconnects that leave no request running, and ``bench --endpoint``
through the router with one server's metric set."""
import asyncio
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from minibatch_engine import LLM, SamplingParams  # noqa: E402
from minibatch_engine.entrypoints.server import ServerThread, make_app  # noqa: E402
from minibatch_engine.entrypoints.server.metrics import parse_metrics  # noqa: E402
from minibatch_engine.entrypoints.server.router_app import ROUTED_HEADER, build_router_app, federate  # noqa: E402

from .server_fixtures import IDLE, OPTS, free_port, metrics, post, streams_that_leave, wait_idle  # noqa: E402


@pytest.fixture(scope="module")
def backends():
    servers = [ServerThread(make_app("tiny", **OPTS)).start() for _ in range(3)]
    yield servers
    for s in servers:
        s.stop()


def router(backends, **kw):
    return ServerThread(build_router_app([s.url for s in backends], poll_interval=0.1, **kw))


def test_greedy_text_through_the_router_equals_the_offline_llm_streamed_or_not(backends):
    prompts = ["The cat", "Serving under load", "a", "routers"]
    want = LLM("tiny", **OPTS).generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    with router(backends) as r:
        client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="EMPTY", max_retries=0)
        for p, w in zip(prompts, want):
            args = dict(model="tiny", prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
            assert client.completions.create(**args).choices[0].text == w.outputs[0].text
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == w.outputs[0].text
            assert chunks[-1].usage.completion_tokens == 8
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens == 4
        assert [m.id for m in client.models.list().data] == ["tiny"]


def test_round_robin_takes_the_backends_in_turn_and_errors_pass_through(backends):
    with router(backends, policy="round-robin") as r:
        seen = [post(r.url, {"prompt": f"turn {i}", "max_tokens": 2})[2][ROUTED_HEADER] for i in range(6)]
        assert seen == [s.url for s in backends] * 2
        status, err, _ = post(r.url, {"prompt": "x", "max_tokens": 0})
        assert status == 400 and err["error"]["param"] == "max_tokens"          # the backend's own answer
        status, err, _ = post(r.url, {"model": "gpt-4", "prompt": "x"})
        assert status == 404
        m = metrics(r.url)
        routed = [m[f'minibatch_router:requests_routed_total{{backend="{s.url}"}}'] for s in backends]
        assert routed == [3, 3, 2]                                               # 6 in turn, then 2 errors
        assert all(m[f'minibatch_router:requests_in_flight{{backend="{s.url}"}}'] == 0 for s in backends)


def test_prefix_affinity_keeps_a_shared_prefix_on_one_backend_within_the_load_guard(backends):
    shared = list(range(1, 97))                  # 6 blocks of 16 tokens

    async def main(url):
        async with aiohttp.ClientSession() as session:
            async def send(suffix, max_tokens=2, stream=False):
                body = {"prompt": shared + suffix, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
                return await session.post(f"{url}/v1/completions", json=body)
            first = await send([200])
            home = first.headers[ROUTED_HEADER]
            await first.read()
            others = []
            for i in range(3):                   # sequential: nothing in flight, the prefix decides
                r = await send([201 + i])
                others.append(r.headers[ROUTED_HEADER])
                await r.read()
            long = await send([210], max_tokens=150, stream=True)     # held open: home has 1 in flight
            assert long.status == 200 and long.headers[ROUTED_HEADER] == home
            await long.content.readline()
            busy = await send([211])
            moved = busy.headers[ROUTED_HEADER]
            await busy.read()
            long.close()
            fresh = await send([7, 7, 7] * 40)     # no shared prefix: the least busy, lowest index
            return home, others, moved, fresh.headers[ROUTED_HEADER]
    with router(backends, policy="prefix", max_imbalance=1) as r:
        home, others, moved, _ = asyncio.run(main(r.url))
        assert others == [home] * 3 and moved == home       # 1 in flight is within a guard of 1
    with router(backends, policy="prefix", max_imbalance=0) as r:
        home, others, moved, fresh = asyncio.run(main(r.url))
        assert others == [home] * 3 and moved != home       # a guard of 0 sends it elsewhere
        assert home == backends[0].url
    assert fresh == backends[0].url


def test_clients_that_leave_through_the_router_leave_nothing_running_on_the_backends(backends, caplog):
    with router(backends, policy="least-requests") as r:
        outcomes = streams_that_leave(r.url, 60, max_tokens=60)
        assert outcomes.count("left") > 15 and outcomes.count("done") > 5
        assert all(wait_idle(s.url, 20) == IDLE for s in backends)
        m = metrics(r.url)
        assert sum(m[f'minibatch_router:requests_in_flight{{backend="{s.url}"}}'] for s in backends) == 0
        aborted = sum(v for k, v in m.items() if k.startswith("minibatch:request_success_total")
                      and 'finished_reason="abort"' in k)
        assert aborted > 0                       # the backends' own counters, federated
    # a client leaving is not a server error: no "Error handling request" traceback
    assert not [rec for rec in caplog.records if "Error handling request" in rec.getMessage()]


def test_a_backend_that_is_down_is_skipped_and_none_left_answers_503(backends):
    dead = f"http://127.0.0.1:{free_port()}"
    with ServerThread(build_router_app([dead, backends[0].url], poll_interval=60)) as r:
        for i in range(3):
            status, _, headers = post(r.url, {"prompt": f"up {i}", "max_tokens": 2})
            assert status == 200 and headers[ROUTED_HEADER] == backends[0].url
        m = metrics(r.url)
        assert m[f'minibatch_router:backend_up{{backend="{dead}"}}'] == 0
        assert urllib.request.urlopen(f"{r.url}/health").status == 200
    with ServerThread(build_router_app([dead], poll_interval=60)) as r:
        status, err, headers = post(r.url, {"prompt": "x", "max_tokens": 2})
        assert status == 503 and dead in err["error"]["message"] and headers["Retry-After"] == "1"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{r.url}/health")
        assert e.value.code == 503


def test_bad_router_arguments_are_named():
    for kw, word in [(dict(backends=[]), "at least one backend"), (dict(backends=["localhost:1"]), "URL"),
                     (dict(backends=["http://a", "http://a/v1"]), "twice"),
                     (dict(backends=["http://a"], policy="fastest"), "fastest"),
                     (dict(backends=["http://a"], policy="round-robin", max_imbalance=2), "max_imbalance"),
                     (dict(backends=["http://a"], model="/nonexistent"), "tokenizer")]:
        with pytest.raises(ValueError, match=word):
            build_router_app(**kw)
    from minibatch_engine.entrypoints.cli import main
    assert main(["route"]) == 2 and main(["route", "--backend", "http://a", "--policy", "x"]) == 2


def test_federated_metrics_label_each_backend_and_keep_one_header_per_series():
    text = ('# HELP minibatch:x_total X.\n# TYPE minibatch:x_total counter\nminibatch:x_total{model_name="t"} 2.0\n'
            '# HELP minibatch:y Y.\n# TYPE minibatch:y gauge\nminibatch:y 1.0\n')
    out = federate({"http://a": text, "http://b": text.replace("2.0", "3.0")})
    assert out.count("# TYPE minibatch:x_total") == 1
    assert parse_metrics(out) == {'minibatch:x_total{backend="http://a",model_name="t"}': 2.0,
                                  'minibatch:x_total{backend="http://b",model_name="t"}': 3.0,
                                  'minibatch:y{backend="http://a"}': 1.0, 'minibatch:y{backend="http://b"}': 1.0}


def test_bench_endpoint_through_the_router_has_one_servers_metric_set(backends):
    from minibatch_engine.harness.endpoint_client import bench_endpoint
    with router(backends[:2], policy="prefix") as r:
        one = bench_endpoint(backends[2].url, num_requests=6, arrival_rate=40.0, progress=False,
                             goodput=["ttft:500"])
        both = bench_endpoint(r.url, num_requests=6, arrival_rate=40.0, progress=False, goodput=["ttft:500"])
        m = metrics(r.url)
    assert set(one) - {"first_error"} == set(both) - {"first_error"}
    assert both["completed"] == one["completed"] == 6 and both["output_tokens"] == one["output_tokens"]
    assert both["server_generation_tokens_total"] == both["output_tokens"]      # summed over the backends
    assert sum(m[f'minibatch_router:requests_routed_total{{backend="{s.url}"}}'] for s in backends[:2]) == 6


def test_the_prefix_key_is_the_token_ids_or_the_tokenizers_or_the_bytes():
    from minibatch_engine.model.registry import tokenizer_for
    from minibatch_engine.entrypoints.server.router_app import prefix_key
    comp, chat = "/v1/completions", "/v1/chat/completions"
    assert prefix_key({"prompt": [5, 6, 7]}, comp, None) == [5, 6, 7]
    assert prefix_key({"prompt": [[5, 6], [8]]}, comp, None) == [5, 6]
    assert prefix_key({"prompt": "hé"}, comp, None) == list("hé".encode())
    tok = tokenizer_for("tiny")
    assert prefix_key({"prompt": "hé"}, comp, tok) == tok.encode("hé")
    one = prefix_key({"messages": [{"role": "user", "content": "hi"}]}, chat, None)
    two = prefix_key({"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "yo"}]}, chat, None)
    assert two[:len(one)] == one                     # a longer conversation extends the key
    app = build_router_app(["http://a"], model="tiny-py")
    from minibatch_engine.entrypoints.server.launch import STATE_KEY
    assert app[STATE_KEY]["tokenizer"] is not None
