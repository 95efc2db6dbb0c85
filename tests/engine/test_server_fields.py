"""The server's log-probabilities, ``echo``, sampling extensions and refusals,
through the official ``openai`` client and raw HTTP: what lm-eval and other
clients send works, and every known field is honoured or refused by name."""
import json
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")

from minibatch_engine import LLM, SamplingParams  # noqa: E402
from minibatch_engine.model.reference import full_forward_logits  # noqa: E402
from minibatch_engine.entrypoints.server.request_fields import REFUSED_BOTH, REFUSED_CHAT  # noqa: E402

from .server_fixtures import OPTS, client, offline, server  # noqa: E402,F401 (fixtures)


def post(server, path, body):
    req = urllib.request.Request(f"{server.url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def reference(model, ids):
    """float64 log-softmax of a lone full recompute: row p scores token p + 1."""
    return torch.log_softmax(full_forward_logits(model, ids).double(), dim=-1)


def test_completion_logprobs_equal_the_offline_engine_and_a_recompute(client, offline):
    r = client.completions.create(model="tiny", prompt="The cat", max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    want = offline.generate(["The cat"], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2),
                            use_tqdm=False)[0].outputs[0]
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t].logprob for t, d in zip(want.token_ids, want.logprobs)],
                                              abs=1e-5)
    ref = reference(offline.model, offline.tokenizer.encode("The cat") + want.token_ids)
    P = len(offline.tokenizer.encode("The cat"))
    assert lp.token_logprobs == pytest.approx([ref[P - 1 + i, t].item() for i, t in enumerate(want.token_ids)],
                                              abs=1e-4)
    assert all(len(d) in (2, 3) and max(d.values()) >= v for d, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert len(lp.tokens) == 6


def test_logprobs_zero_returns_the_sampled_token(client):
    r = client.completions.create(model="tiny", prompt="a", max_tokens=3, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and all(isinstance(v, float) for v in lp.token_logprobs)
    assert [len(d) for d in lp.top_logprobs] == [1, 1, 1]


def test_lm_eval_loglikelihood_request(server, offline):
    """lm-eval's local-completions: token ids, echo, logprobs=1, max_tokens=1."""
    ids = offline.tokenizer.encode("Question: two plus two? Answer: four")
    status, body = post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 1,
                                                    "max_tokens": 1, "temperature": 0, "seed": 1234})
    assert status == 200
    c = body["choices"][0]
    lp = c["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    ref = reference(offline.model, ids)
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([ref[p - 1, ids[p]].item()
                                                             for p in range(1, len(ids))], abs=1e-4)
    assert c["text"].startswith(offline.tokenizer.decode(ids))
    # what lm-eval computes: the continuation's sum and whether it was greedy
    for tok_lp, top in zip(lp["token_logprobs"][1:-1], lp["top_logprobs"][1:-1]):
        assert max(top.values()) >= tok_lp
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_lm_eval_batched_loglikelihood_request(server, offline):
    """lm-eval's ``--batch_size 4``: several token-id prompts of different
    lengths in one request; choice i scores prompt i, as lm-eval reads it
    (the continuation's sum: ``token_logprobs[ctxlen:-1]``)."""
    texts = ["import os", "for i in range(3):", "x", "def f(a, b):\n    return a"]
    prompts = [offline.tokenizer.encode(t) for t in texts]
    status, body = post(server, "/v1/completions", {"model": "tiny", "prompt": prompts, "echo": True,
                                                    "logprobs": 1, "max_tokens": 1, "temperature": 0})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for ids, c in zip(prompts, body["choices"]):
        lps = c["logprobs"]["token_logprobs"]
        assert len(lps) == len(ids) + 1
        ref = reference(offline.model, ids)
        ctxlen = max(1, len(ids) // 2)
        assert sum(lps[ctxlen:-1]) == pytest.approx(sum(ref[p - 1, ids[p]].item()
                                                        for p in range(ctxlen, len(ids))), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_scores_the_prompt_alone(server, offline, stream):
    """OpenAI's legacy scoring request, which vLLM serves (older lm-eval and
    HELM send it): ``echo`` with ``max_tokens: 0`` returns the prompt and its
    log-probabilities, and no completion."""
    ids = offline.tokenizer.encode("The cat sat")
    body = {"model": "tiny", "prompt": "The cat sat", "echo": True, "logprobs": 2, "max_tokens": 0,
            "temperature": 0, "stream": stream}
    req = urllib.request.Request(f"{server.url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        raw = r.read().decode()
    if stream:
        chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        lps = sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks
                   if c["choices"][0]["logprobs"]), [])
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        c = json.loads(raw)["choices"][0]
        text, lps, reason = c["text"], c["logprobs"]["token_logprobs"], c["finish_reason"]
        assert json.loads(raw)["usage"]["completion_tokens"] == 0
        assert len(c["logprobs"]["top_logprobs"]) == len(ids)
    assert text == "The cat sat" and reason == "length"
    ref = reference(offline.model, ids)
    assert lps[0] is None and lps[1:] == pytest.approx([ref[p - 1, ids[p]].item() for p in range(1, len(ids))],
                                                       abs=1e-4)


def test_max_tokens_zero_needs_echo(server):
    for path, extra in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        status, err = post(server, path, {"model": "tiny", "max_tokens": 0, **extra})
        assert status == 400 and err["error"]["param"] == "max_tokens", err


def test_prompt_logprobs_vllm_extension(server, offline):
    ids = offline.tokenizer.encode("Hello there")
    status, body = post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 2,
                                                    "prompt_logprobs": 3, "temperature": 0})
    assert status == 200
    pl = body["choices"][0]["prompt_logprobs"]
    ref = reference(offline.model, ids)
    assert pl[0] is None and len(pl) == len(ids)
    for p in range(1, len(ids)):
        assert pl[p][str(ids[p])]["logprob"] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert len(pl[p]) >= 3


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for item in content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob >= item.logprob - 1e-6
        assert item.bytes == list(item.token.encode())
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_equal_the_whole_ones(client):
    kw = dict(model="tiny", prompt="Serving", max_tokens=5, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs.token_logprobs
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs]
    assert sum((c.choices[0].logprobs.token_logprobs for c in chunks), []) == pytest.approx(whole, abs=1e-6)


def test_streamed_echo_sends_the_prompt_first(client):
    chunks = list(client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0, echo=True,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].text == "abc"
    whole = client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


# (the field under test, fields the comparison without it keeps); 32 tokens: the tiny model repeats itself
EXTRAS = [(dict(presence_penalty=2.0, frequency_penalty=2.0), {}), (dict(repetition_penalty=2.0), {}),
          (dict(min_tokens=5), dict(stop_token_ids=[4])), (dict(bad_words=[">"]), {}),
          (dict(logit_bias={101: 100.0}), {}), (dict(min_p=0.2), dict(temperature=0.8, seed=3))]


@pytest.mark.parametrize("extra,keep", EXTRAS)
def test_sampling_extensions_equal_the_offline_engine(server, offline, extra, keep):
    body = {"model": "tiny", "prompt": "the theme then", "max_tokens": 32, "temperature": 0, **keep, **extra}
    if "logit_bias" in extra:
        body["logit_bias"] = {str(k): v for k, v in extra["logit_bias"].items()}
    status, r = post(server, "/v1/completions", body)
    assert status == 200, r
    params = SamplingParams(**{"max_tokens": 32, "temperature": 0.0, **keep, **extra})
    want = offline.generate(["the theme then"], params, use_tqdm=False)[0].outputs[0]
    assert r["choices"][0]["text"] == want.text
    without = offline.generate(["the theme then"], SamplingParams(**{"max_tokens": 32, **keep}),
                               use_tqdm=False)[0].outputs[0]
    if "min_p" not in extra:                     # (min_p: the seeded draws may agree)
        assert want.token_ids != without.token_ids           # the field did something


def test_include_stop_str_and_truncation(server, offline):
    text = offline.generate(["hello"], SamplingParams(max_tokens=20), use_tqdm=False)[0].outputs[0].text
    stop = text[3:5]
    _, r = post(server, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 20,
                                            "temperature": 0, "stop": [stop], "include_stop_str_in_output": True})
    assert r["choices"][0]["text"] == text[:text.find(stop) + len(stop)]
    _, r = post(server, "/v1/completions", {"model": "tiny", "prompt": "a long prompt here", "max_tokens": 2,
                                            "truncate_prompt_tokens": 4, "echo": True, "temperature": 0})
    assert r["usage"]["prompt_tokens"] == 4 and r["choices"][0]["text"].startswith("here")


def test_add_generation_prompt(server):
    msgs = [{"role": "user", "content": "Hi"}]
    _, on = post(server, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 1})
    _, off = post(server, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_tokens": 1,
                                                   "add_generation_prompt": False})
    assert on["usage"]["prompt_tokens"] - off["usage"]["prompt_tokens"] == len("<|assistant|>\n")


def _on(name):
    """A value that switches a refused field on."""
    return {"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True, "skip_special_tokens": False,
            "spaces_between_special_tokens": False, "add_special_tokens": True, "return_tokens_as_token_ids": True,
            "return_token_ids": True, "continue_final_message": True, "include_reasoning": True,
            "echo": True, "suffix": "x", "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "auto", "functions": [{"name": "f"}], "function_call": "auto",
            "service_tier": "flex", "modalities": ["audio"], "chat_template_kwargs": {"x": 1},
            "prompt_logprobs": 1, "top_logprobs": 2,
            "best_of": 3, "store": True}.get(name, "x")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name", sorted(set(REFUSED_BOTH) | set(REFUSED_CHAT) | {"top_logprobs"}))
def test_every_unimplemented_field_is_refused_by_name(server, chat, name):
    if (name in REFUSED_CHAT and not chat) or (name == "top_logprobs" and chat):
        pytest.skip("implemented on this endpoint")
    base = {"model": "tiny", "max_tokens": 1}
    base.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
    status, err = post(server, "/v1/chat/completions" if chat else "/v1/completions", {**base, name: _on(name)})
    assert status == 400 and err["error"]["param"] == name, err


@pytest.mark.parametrize("fmt,ok", [({"type": "text"}, True), ({"type": "structural_tag"}, False),
                                    ({"type": "json_schema", "json_schema": {"name": "x"}}, False)])
def test_response_format_is_checked(server, fmt, ok):
    """(Structured output itself: test_server_structured_output.py.)"""
    status, err = post(server, "/v1/chat/completions", {"model": "tiny", "max_tokens": 1, "response_format": fmt,
                                                        "messages": [{"role": "user", "content": "x"}]})
    assert (status == 200) == ok and (ok or err["error"]["param"] == "response_format")


@pytest.mark.parametrize("body,param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 2}, "min_p"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"), ({"min_tokens": 50, "max_tokens": 4}, "min_tokens"),
    ({"bad_words": "x"}, "bad_words"), ({"echo": 1}, "echo"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt_logprobs": 99}, "prompt_logprobs"),
])
def test_bad_extension_values_name_the_field(server, body, param):
    status, err = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4, **body})
    assert status == 400 and err["error"]["param"] == param, err


def test_chat_top_logprobs_needs_logprobs(server):
    status, err = post(server, "/v1/chat/completions", {"model": "tiny", "top_logprobs": 2,
                                                        "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and err["error"]["param"] == "top_logprobs"


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm sends it): each
    chunk's usage counts the tokens streamed so far; the last equals the total."""
    chunks = list(client.completions.create(
        model="tiny", prompt="The cat", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]     # one chunk per token
    assert counts == [1, 2, 3, 4, 5]
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens} and not chunks[-1].choices
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.total_tokens == 5 + chunks[-1].usage.prompt_tokens
    plain = list(client.completions.create(model="tiny", prompt="The cat", max_tokens=5, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)