"""What real clients and deployments need beside generation (issue 41, items 1
and 6): the tokenizer routes in vLLM's shapes and ``root`` in ``/v1/models``
(``AutoTokenizer`` from that folder encodes as ``/tokenize`` does), the API
key on ``/v1/*`` only, CORS preflights, metric names under either prefix,
prefix-cache counters equal to the engine's own counts, and vLLM's
per-request token histograms."""
import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from minibatch_engine.entrypoints.server import ServerThread, make_app  # noqa: E402
from minibatch_engine.entrypoints.server.access import CorsPolicy  # noqa: E402
from minibatch_engine.entrypoints.server.metrics import parse_metrics, token_buckets  # noqa: E402

OPTS = dict(device="cpu", attention_backend="sdpa", max_num_seqs=8, max_model_len=256)
TEXTS = ["def add(a, b):\n    return a + b\n", "héllo wörld ✓", "a<|eos|>b", ""]


def call(url, body=None, headers=None, method=None):
    """(status, headers, parsed JSON or text) of one HTTP request."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as r:
            status, hdrs, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, e.headers, e.read()
    try:
        return status, hdrs, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, hdrs, raw.decode()


@pytest.fixture(scope="module")
def tiny_py():
    with ServerThread(make_app("tiny-py", **OPTS)) as s:
        yield s


# --- item 1: the tokenizer over HTTP ----------------------------------------------
def test_models_root_names_the_folder_autotokenizer_loads_and_it_encodes_as_tokenize(tiny_py):
    transformers = pytest.importorskip("transformers")
    client = openai.OpenAI(base_url=f"{tiny_py.url}/v1", api_key="EMPTY", max_retries=0)
    card = client.models.list().data[0]
    root = card.model_extra["root"] if card.model_extra else card.root
    hf = transformers.AutoTokenizer.from_pretrained(root, local_files_only=True)
    for text in TEXTS:
        status, _, out = call(f"{tiny_py.url}/tokenize", {"prompt": text})
        assert status == 200
        want = hf(text, add_special_tokens=False)["input_ids"]
        assert out["tokens"] == want == tiny_py.llm.tokenizer.encode(text)
        assert out["count"] == len(want) and out["max_model_len"] == card.model_extra["max_model_len"]
        assert call(f"{tiny_py.url}/detokenize", {"tokens": out["tokens"]})[2] == \
            {"prompt": hf.decode(want, skip_special_tokens=True)}


def test_tokenize_chat_token_strs_and_refusals(tiny_py):
    msgs = [{"role": "user", "content": "hi"}]
    _, _, out = call(f"{tiny_py.url}/tokenize", {"messages": msgs, "return_token_strs": True})
    assert bytes(out["tokens"]).decode() == "<|user|>\nhi\n<|assistant|>\n"
    transformers = pytest.importorskip("transformers")
    root = call(f"{tiny_py.url}/v1/models")[2]["data"][0]["root"]
    hf = transformers.AutoTokenizer.from_pretrained(root, local_files_only=True)
    assert out["token_strs"] == hf.convert_ids_to_tokens(out["tokens"])       # a newline is "Ċ", as in vLLM
    _, _, bare = call(f"{tiny_py.url}/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert bytes(bare["tokens"]).decode() == "<|user|>\nhi\n"
    assert call(f"{tiny_py.url}/tokenize", {"prompt": "<|eos|>", "return_token_strs": True})[2]["token_strs"] \
        == ["<|eos|>"]
    for body, param in [({}, "prompt"), ({"prompt": 3}, "prompt"),
                        ({"prompt": "x", "model": "nope"}, "model"),
                        ({"messages": msgs, "continue_final_message": True}, "continue_final_message")]:
        status, _, err = call(f"{tiny_py.url}/tokenize", body)
        assert status in (400, 404) and err["error"]["param"] == param
    status, _, err = call(f"{tiny_py.url}/detokenize", {"tokens": [1, 99999]})
    assert status == 400 and err["error"]["param"] == "tokens"


def test_tokenizer_info_is_what_lm_eval_probes(tiny_py):
    """lm-eval's remote tokenizer: ``eos_token`` in /tokenizer_info, then its id
    as the first token /tokenize gives for that text."""
    status, _, info = call(f"{tiny_py.url}/tokenizer_info")
    assert status == 200 and info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["chat_template"] and info["model_max_length"] > 0
    for key, want in [("eos_token", tiny_py.llm.tokenizer.eos_token_id),
                      ("bos_token", tiny_py.llm.tokenizer.bos_token_id)]:
        ids = call(f"{tiny_py.url}/tokenize", {"prompt": info[key], "add_special_tokens": False})[2]["tokens"]
        assert ids == [want]


# --- item 6: the API key -----------------------------------------------------------
def test_the_api_key_guards_v1_only():
    with ServerThread(make_app("tiny", api_keys=["sekrit"], **OPTS)) as s:
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens == 2
        bad = openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.body["type"] == "invalid_request_error"
        status, hdrs, err = call(f"{s.url}/v1/chat/completions", {"messages": []})
        assert status == 401 and hdrs["WWW-Authenticate"] == "Bearer" and "API key" in err["error"]["message"]
        for path in ("/health", "/metrics", "/tokenizer_info"):        # open, as in vLLM
            assert call(f"{s.url}{path}")[0] == 200


# --- item 6: CORS --------------------------------------------------------------------
def test_cors_preflight_and_responses_name_only_allowed_origins():
    cors = CorsPolicy(("http://app.example",))
    with ServerThread(make_app("tiny", api_keys=["k"], cors=cors, **OPTS)) as s:
        pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
        status, hdrs, _ = call(f"{s.url}/v1/completions", headers=pre, method="OPTIONS")
        assert status == 204                                      # before the key: browsers send none here
        assert hdrs["Access-Control-Allow-Origin"] == "http://app.example"
        assert "POST" in hdrs["Access-Control-Allow-Methods"]
        assert "Authorization" in hdrs["Access-Control-Allow-Headers"]
        status, _, _ = call(f"{s.url}/v1/completions", headers={**pre, "Origin": "http://evil.example"},
                            method="OPTIONS")
        assert status == 403
        ok = {"Origin": "http://app.example", "Authorization": "Bearer k"}
        status, hdrs, _ = call(f"{s.url}/v1/completions", {"prompt": "a", "max_tokens": 1}, headers=ok)
        assert status == 200 and hdrs["Access-Control-Allow-Origin"] == "http://app.example"
        status, hdrs, _ = call(f"{s.url}/v1/completions", {"prompt": "a", "max_tokens": 1},
                               headers={"Origin": "http://app.example"})
        assert status == 401 and hdrs["Access-Control-Allow-Origin"] == "http://app.example"
        status, hdrs, _ = call(f"{s.url}/v1/models", headers={"Origin": "http://evil.example",
                                                              "Authorization": "Bearer k"})
        assert status == 200 and "Access-Control-Allow-Origin" not in hdrs


def test_no_cors_headers_by_default(tiny_py):
    status, hdrs, _ = call(f"{tiny_py.url}/v1/models", headers={"Origin": "http://app.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in hdrs


# --- item 6: metrics -----------------------------------------------------------------
def test_metric_names_under_each_prefix_and_both():
    names = ["num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"]
    for prefixes in [("vllm",), ("minibatch",), ("vllm", "minibatch")]:
        with ServerThread(make_app("tiny", metrics_prefixes=prefixes, **OPTS)) as s:
            m = parse_metrics(call(f"{s.url}/metrics")[2])
            for p in ("vllm", "minibatch"):
                for n in names + ["prefix_cache_queries_total", "prefix_cache_hits_total"]:
                    assert (f'{p}:{n}{{model_name="tiny"}}' in m) == (p in prefixes), (prefixes, p, n)
    with pytest.raises(ValueError, match="metrics-prefix"):
        make_app("tiny", metrics_prefixes=("9bad name",), **OPTS)


def test_prefix_cache_counters_equal_the_engine_counts_and_token_histograms_count_requests():
    """A shared 48-token system prompt, sent one request after another: every
    request after the first finds its full blocks cached."""
    system = "You are a careful assistant. Answer briefly.\n" + "x" * 3
    prompts = [system + q for q in ("one?", "two??", "three???", "four????")]
    with ServerThread(make_app("tiny", metrics_prefixes=("vllm",), history=None, **OPTS)) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="EMPTY", max_retries=0)
        gen = []
        for p in prompts:
            gen.append(client.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0,
                                                 extra_body={"ignore_eos": True}).usage.completion_tokens)
        m = parse_metrics(call(f"{s.url}/metrics")[2])
        reqs = list(s.llm.engine.requests.values())
        lab = '{model_name="tiny"}'
        hits = sum(r.num_cached_tokens for r in reqs)
        assert hits > 0 and m[f"vllm:prefix_cache_hits_total{lab}"] == hits
        assert m[f"vllm:prefix_cache_queries_total{lab}"] == sum(len(p.encode()) for p in prompts)
        assert hits == 3 * (len(system.encode()) // 16 * 16)       # full blocks of the shared prefix
        assert m[f"vllm:request_prompt_tokens_count{lab}"] == len(prompts)
        assert m[f"vllm:request_prompt_tokens_sum{lab}"] == sum(len(p.encode()) for p in prompts)
        assert m[f"vllm:request_generation_tokens_sum{lab}"] == sum(gen) == 12
        buckets = token_buckets(256)
        assert buckets == [1, 2, 5, 10, 20, 50, 100, 200]
        assert m[f'vllm:request_generation_tokens_bucket{{le="5.0",model_name="tiny"}}'] == 4
        assert m[f'vllm:request_generation_tokens_bucket{{le="2.0",model_name="tiny"}}'] == 0


# --- item 6: the router --------------------------------------------------------------
def test_the_router_reads_kv_usage_under_any_prefix():
    from minibatch_engine.entrypoints.server.router_app import kv_usage_from
    for name in ("vllm:kv_cache_usage_perc", "minibatch:kv_cache_usage_perc", "acme:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        assert kv_usage_from(f'# HELP {name} x\n{name}{{model_name="m"}} 0.25\n') == 0.25
    assert kv_usage_from('minibatch_router:backend_kv_cache_usage_perc{backend="a"} 0.9\n') == 0.0
    assert kv_usage_from("") == 0.0


def test_the_router_asks_for_the_key_and_sends_it_to_backends_that_use_the_vllm_prefix():
    from minibatch_engine.entrypoints.server.router_app import ROUTED_HEADER, build_router_app
    backends = [ServerThread(make_app("tiny", api_keys=["k"], metrics_prefixes=("vllm",), **OPTS)).start()
                for _ in range(2)]
    try:
        app = build_router_app([b.url for b in backends], policy="round-robin",
                               poll_interval=0.1, api_key="k")
        with ServerThread(app) as r:
            good = openai.OpenAI(base_url=f"{r.url}/v1", api_key="k", max_retries=0)
            status, hdrs, _ = call(f"{r.url}/v1/completions", {"prompt": "a", "max_tokens": 2},
                                   headers={"Authorization": "Bearer k"})
            assert status == 200 and hdrs[ROUTED_HEADER] in {b.url for b in backends}
            assert good.models.list().data[0].id == "tiny"
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{r.url}/v1", api_key="no", max_retries=0).models.list()
        with ServerThread(build_router_app([b.url for b in backends], poll_interval=0.1)) as r:
            # no router key: the client's own passes through, to /v1/models too
            assert openai.OpenAI(base_url=f"{r.url}/v1", api_key="k", max_retries=0).models.list().data
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{r.url}/v1", api_key="no", max_retries=0).models.list()
    finally:
        for b in backends:
            b.stop()


def test_serve_flags_and_the_environment_choose_the_key_cors_and_prefixes(monkeypatch):
    from minibatch_engine.entrypoints.cli import _access_options, build_parser
    parse = build_parser().parse_args
    for name in ("MINIBATCH_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert _access_options(parse(["serve"])) == {"api_keys": None, "cors": None,
                                                 "metrics_prefixes": ("minibatch",)}
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert _access_options(parse(["serve"]))["api_keys"] == ["from-vllm"]
    monkeypatch.setenv("MINIBATCH_API_KEY", "ours")
    assert _access_options(parse(["serve"]))["api_keys"] == ["ours"]
    opts = _access_options(parse(["serve", "--api-key", "flag", "--allowed-origins", "*",
                                  "--metrics-prefix", "vllm", "minibatch"]))
    assert opts["api_keys"] == ["flag"] and opts["cors"].allowed_origins == ("*",)
    assert opts["metrics_prefixes"] == ("vllm", "minibatch")
    with pytest.raises(ValueError, match="allow-credentials"):
        _access_options(parse(["serve", "--allowed-origins", "*", "--allow-credentials"]))
