"""One request's failure inside ``Engine.step`` ends that request alone (issue 38,
item 2): a priority is bounded where it enters (the Python API, ``serve``), and
a failure in a request's own part of a step (its scheduling arithmetic, its
sampling, its stop checks) gives it finish reason ``error`` while the engine
loop and the other requests go on."""
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from minibatch_engine import AsyncLLM, LLM, SamplingParams, reference_generate
from minibatch_engine.core.request import PRIORITY_MAX, PRIORITY_MIN, Request, check_priority
from minibatch_engine.scheduler.policy import PriorityPolicy

from ..conftest import assert_all_memory_back

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
AGING = dict(max_num_seqs=4, policy="priority", priority_aging_s=0.5)


@pytest.mark.parametrize("bad", [10**400, -10**400, 2**31, -2**31 - 1, 2**63],
                         ids=["10**400", "-10**400", "2**31", "-2**31-1", "2**63"])
def test_a_priority_outside_32_bits_is_refused_by_name_before_anything_runs(tiny64, bad):
    llm = LLM(tiny64, **AGING)
    with pytest.raises(ValueError, match=r"priority\[1\] must be an integer in \[-2147483648, 2147483647\]"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=3), priority=[0, bad, 1], use_tqdm=False)
    assert check_priority(PRIORITY_MIN) == PRIORITY_MIN and check_priority(PRIORITY_MAX) == PRIORITY_MAX


def test_the_extreme_priorities_run_under_aging(tiny64):
    llm = LLM(tiny64, **AGING)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True),
                        priority=[PRIORITY_MAX, PRIORITY_MIN, 0], use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == reference_generate(tiny64, p, 4)


def _fail_ordering_of(monkeypatch, priority):
    """The priority policy's arithmetic raises for requests of this priority."""
    real = PriorityPolicy.effective_priority

    def effective_priority(self, req, now=None):
        if req.priority == priority:
            raise OverflowError("int too large to convert to float")
        return real(self, req, now)
    monkeypatch.setattr(PriorityPolicy, "effective_priority", effective_priority)


def _fail_stop_check_of(monkeypatch, request_id):
    """A request's stop check (``Request.append_token``) raises on its third token."""
    real = Request.append_token

    def append_token(self, token, step):
        if self.request_id == request_id and self.num_output_tokens == 2:
            raise ValueError("a stop check that fails")
        return real(self, token, step)
    monkeypatch.setattr(Request, "append_token", append_token)


@pytest.mark.parametrize("where", ["scheduling", "stop check"])
def test_a_failure_in_one_requests_step_ends_it_alone(tiny64, monkeypatch, where):
    if where == "scheduling":
        _fail_ordering_of(monkeypatch, priority=7)
    else:
        _fail_stop_check_of(monkeypatch, request_id="1")
    llm = LLM(tiny64, **AGING)
    params = [SamplingParams(max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True, n=2, temperature=0.8, seed=3)]
    outs = llm.generate(PROMPTS, params, priority=[0, 7, 1], use_tqdm=False)
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error"
    assert len(bad.token_ids) == (0 if where == "scheduling" else 2)
    message = llm.engine.requests["1"].error
    assert ("OverflowError" if where == "scheduling" else "a stop check that fails") in message
    assert outs[0].outputs[0].token_ids == reference_generate(tiny64, PROMPTS[0], 5)
    assert [o.finish_reason for o in outs[2].outputs] == ["length", "length"]
    assert_all_memory_back(llm.engine)


def test_a_failing_stream_ends_alone_and_the_loop_goes_on(tiny64, monkeypatch):
    _fail_ordering_of(monkeypatch, priority=7)
    llm = AsyncLLM(tiny64, **AGING)

    async def collect(prompt, priority):
        return [o async for o in llm.stream(prompt, SamplingParams(max_tokens=4, ignore_eos=True),
                                            priority=priority)]

    async def main():
        runs = await asyncio.gather(*(collect(p, q) for p, q in zip(PROMPTS, [0, 7, 1])))
        later = await collect(PROMPTS[0], 2)
        await llm.shutdown()
        return runs, later
    (good, bad, other), later = asyncio.run(main())
    assert [o.finish_reason for o in bad] == ["error"]
    ref = reference_generate(tiny64, PROMPTS[0], 4)
    assert [o.token_id for o in good] == ref == [o.token_id for o in later]
    assert other[-1].finish_reason == "length" and llm._error is None


# --- through serve --------------------------------------------------------------------
def _post(url, body):
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health(url):
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_serve_with_aging_answers_400_to_a_huge_priority_and_goes_on():
    pytest.importorskip("aiohttp")
    from .server_fixtures import free_port, wait_started
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINIBATCH_NO_CPP": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minibatch_engine", "serve", "--model", "tiny",
                             "--port", str(port), "--device", "cpu", "--attention-backend", "sdpa",
                             "--policy", "priority", "--priority-aging-s", "0.5"],
                            env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_started(proc, url)
        base = {"prompt": "a", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
        for bad in (10**400, -10**400, 2**31, 1.5, "1"):
            status, body = _post(url, {**base, "priority": bad})
            assert status == 400 and body["error"]["param"] == "priority", body
            assert "priority" in body["error"]["message"]
        status, body = _post(url, {**base, "priority": PRIORITY_MAX})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert _health(url) == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def test_serve_a_failure_inside_a_step_ends_that_request_only(tiny64, monkeypatch):
    pytest.importorskip("aiohttp")
    from minibatch_engine.entrypoints.server import ServerThread, make_app
    _fail_ordering_of(monkeypatch, priority=7)
    with ServerThread(make_app(tiny64, device="cpu", attention_backend="sdpa", **AGING)) as s:
        base = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "temperature": 0}

        async def main():
            loop = asyncio.get_running_loop()
            return await asyncio.gather(*(loop.run_in_executor(None, _post, s.url, {**base, "priority": q})
                                          for q in (0, 7, 1)))
        (s0, good), (s1, bad), (s2, other) = asyncio.run(main())
        assert s0 == s2 == 200 and s1 in (200, 500)
        if s1 == 200:
            assert bad["choices"][0]["finish_reason"] == "error"
        assert good["choices"][0]["finish_reason"] == other["choices"][0]["finish_reason"] == "length"
        assert _health(s.url) == 200
        status, later = _post(s.url, {**base, "priority": 0})
        assert status == 200 and later["choices"][0]["text"] == good["choices"][0]["text"]
