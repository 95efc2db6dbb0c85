"""Structured output through the server, with the official ``openai`` client:
OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older
``guided_*`` fields ask for the same thing and get the offline engine's text;
a grammar that cannot be compiled is a 400 naming the field that sent it."""
import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
pytest.importorskip("xgrammar", reason="structured output needs xgrammar: pip install 'minibatch-engine[structured]'")

from minibatch_engine import SamplingParams  # noqa: E402

from .server_fixtures import client, offline, server  # noqa: E402,F401 (fixtures)
from .test_server_fields import post  # noqa: E402
from .test_structured_output import SCHEMAS, validate  # noqa: E402

SCHEMA = SCHEMAS["nested"]
CHAT = [{"role": "user", "content": "Give me a point."}]


def offline_text(offline, prompt, seed, **grammar):
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured_outputs=grammar)
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_response_format_json_schema_equals_the_offline_engine(client, offline, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": SCHEMA, "strict": True}}
    r = client.completions.create(model="tiny", prompt="Point: ", max_tokens=120, temperature=1.0, seed=seed,
                                  extra_body={"response_format": fmt})
    c = r.choices[0]
    validate(json.loads(c.text), SCHEMA)
    want = offline_text(offline, "Point: ", seed, json=SCHEMA)
    assert (c.text, c.finish_reason) == (want.text, want.finish_reason) == (c.text, "stop")
    assert r.usage.completion_tokens == len(want.token_ids)


def test_chat_response_format_json_schema_and_json_object(client):
    for fmt, check in [({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                        lambda v: validate(v, SCHEMA)),
                       ({"type": "json_object"}, lambda v: isinstance(v, dict) or pytest.fail(repr(v)))]:
        for seed in range(3):
            r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=200, temperature=1.0,
                                               seed=seed, response_format=fmt)
            if r.choices[0].finish_reason == "stop":
                check(json.loads(r.choices[0].message.content))
            else:                       # only json_object is unbounded: cut by max_tokens on its way
                assert fmt["type"] == "json_object" and r.choices[0].message.content.startswith("{")


def test_response_format_text_is_free_text(client, offline):
    r = client.completions.create(model="tiny", prompt="ab", max_tokens=8, temperature=0,
                                  extra_body={"response_format": {"type": "text"}, "ignore_eos": True})
    want = offline.generate(["ab"], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text


@pytest.mark.parametrize("old, new", [
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json": SCHEMA}),
    ({"guided_regex": r"[a-z]{2,4}\d"}, {"regex": r"[a-z]{2,4}\d"}),
    ({"guided_choice": ["north", "south", "east"]}, {"choice": ["north", "south", "east"]}),
    ({"guided_grammar": 'root ::= "<" [a-c]+ ">"'}, {"grammar": 'root ::= "<" [a-c]+ ">"'}),
])
def test_guided_fields_and_structured_outputs_are_one_thing(client, offline, old, new):
    got = [client.completions.create(model="tiny", prompt="Go: ", max_tokens=120, temperature=1.0, seed=4,
                                     extra_body=body).choices[0].text for body in (old, {"structured_outputs": new})]
    assert got[0] == got[1] == offline_text(offline, "Go: ", 4, **new).text
    kind, spec = next(iter(new.items()))
    if kind == "regex":
        assert re.fullmatch(spec, got[0])
    elif kind == "choice":
        assert got[0] in spec
    elif kind == "grammar":
        assert re.fullmatch(r"<[a-c]+>", got[0])
    else:
        validate(json.loads(got[0]), SCHEMA)


def test_streamed_n_choices_each_follow_the_grammar(client):
    chunks = list(client.completions.create(model="tiny", prompt="x", max_tokens=40, temperature=1.0, seed=9, n=3,
                                            stream=True, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}))
    texts, reasons = {}, {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
    assert sorted(texts) == [0, 1, 2]
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", t) for t in texts.values()) and set(reasons.values()) == {"stop"}


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_a_bad_grammar_is_a_400_naming_its_field(server, body, param):
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        status, err = post(server, path, {"model": "tiny", "max_tokens": 4, **base, **body})
        assert status == 400 and err["error"]["param"] == param, err
    status, _ = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert status == 200                # the server goes on
