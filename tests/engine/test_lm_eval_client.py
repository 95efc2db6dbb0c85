"""lm-evaluation-harness (EleutherAI's, from PyPI) scores local tasks through
``serve --model tiny-py`` with its documented ``local-completions`` and
``local-chat-completions`` arguments, offline (issue 41, item 8). Its
log-likelihoods equal a float64 lone recompute's, its greedy flags the
recompute's argmax, and its generations the offline engine's greedy text.

The tasks are local YAML files over tiny JSON-lines files (``dataset_path:
json``), so nothing comes from the hub. Skipped when lm-eval or its ``api``
extra is not installed. Each test is one ``lm_eval run``: 15 to 40 s here,
most of it lm-eval importing its dependencies.
"""
import glob
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow          # make test-slow (and make test-clients)
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (the clients extra: make test-clients)")
pytest.importorskip("tenacity", reason="lm-eval's API models need its api extra (the clients extra asks for "
                    "lm-eval[api])")

from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from minibatch_engine import LLM, SamplingParams  # noqa: E402
from minibatch_engine.model.reference import full_forward_logits  # noqa: E402
from minibatch_engine.model.registry import resolve_model  # noqa: E402
from minibatch_engine.entrypoints.server import ServerThread, make_app  # noqa: E402
from minibatch_engine.entrypoints.server.chat_template import load_chat_template  # noqa: E402

MAX_LEN = 128           # the server's max_model_len: the long document needs several windows
# float32 server against a float64 recompute, per scored request (a window's
# or a choice's sum of log-probabilities); measured here: at most 1e-5.
TOL = 2e-4
GEN = {"until": ["\n"], "max_gen_toks": 16}
LONG = "".join(f"def f{i}(x):\n    return x * {i} + {i + 1}\n\n" for i in range(12))

CHOICE_DOCS = [
    {"question": "import", "choices": [" os", " )", " ++"], "answer": 0},
    {"question": "for i in ", "choices": ["range(3):", "banana", "42"], "answer": 0},   # a space moves
    {"question": "# Größe:", "choices": [" 5 €", " ✓", " x"], "answer": 0},          # multi-byte tokens
    {"question": "", "choices": ["def", "class", "))"], "answer": 0},                  # the prefix token
]
ROLLING_DOCS = [{"text": "def main():\n    print('hello')\n"},
                {"text": "# Größe: 5 €\nprint('日本語 ✓')\n"},
                {"text": LONG}]                                                        # > MAX_LEN tokens
GEN_DOCS = [{"prompt": "def add(a, b):\n", "answer": "    return a + b"},
            {"prompt": "class Stack:\n", "answer": "    def __init__(self):"}]


def _task(folder: Path, name: str, docs: list, spec: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{spec}")


@pytest.fixture(scope="module")
def offline():
    return LLM("tiny-py", device="cpu", attention_backend="sdpa")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, offline):
    """Three local tasks: ``multiple_choice`` (one doc's first choice is the
    model's own greedy continuation, so lm-eval's greedy flag is true for it),
    ``loglikelihood_rolling`` and ``generate_until``."""
    folder = tmp_path_factory.mktemp("tasks")
    prompt = "def add(a, b):\n    return"
    greedy = offline.generate([prompt], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    docs = CHOICE_DOCS + [{"question": prompt, "choices": [greedy.outputs[0].text, " None", " 0"], "answer": 0}]
    _task(folder, "mbe_choice", docs, 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
          'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
          "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    _task(folder, "mbe_rolling", ROLLING_DOCS, 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
          'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: bits_per_byte\n'
          "    aggregation: bits_per_byte\n    higher_is_better: false\n")
    _task(folder, "mbe_gen", GEN_DOCS, 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\n'
          f'doc_to_target: "{{{{answer}}}}"\ngeneration_kwargs: {json.dumps({**GEN, "do_sample": False})}\n'
          "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


@pytest.fixture(scope="module")
def server():
    app = make_app("tiny-py", device="cpu", attention_backend="sdpa", max_num_seqs=16, max_model_len=MAX_LEN)
    with ServerThread(app) as s:
        with urllib.request.urlopen(f"{s.url}/v1/models") as r:
            s.model_card = json.loads(r.read())["data"][0]
        yield s


@pytest.fixture(scope="module")
def model64():
    return resolve_model("tiny-py", device="cpu", dtype="float64")


def lm_eval(server, tasks, tmp_path, model: str, model_args: dict, *extra: str) -> dict:
    """``lm_eval run`` as its README shows it (``python -m lm_eval``: this
    interpreter's), offline; its logged samples by task."""
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    names = [p.stem for p in tasks.glob("*.yaml")] if model == "local-completions" else ["mbe_gen"]
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", args, "--tasks", *names,
           "--include_path", str(tasks), "--output_path", str(tmp_path / "out"), "--log_samples", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    samples = {}
    for name in names:
        (path,) = glob.glob(str(tmp_path / "out" / "*" / f"samples_{name}_*.jsonl"))
        samples[name] = sorted((json.loads(line) for line in open(path)), key=lambda s: s["doc_id"])
    return samples


def scored(model64, context: list, continuation: list) -> tuple[float, bool]:
    """The continuation's log-likelihood after the context, and whether it is
    the argmax at every position: a float64 lone recompute."""
    ids = context + continuation
    lp = torch.log_softmax(full_forward_logits(model64, ids).double(), dim=-1)
    rows = lp[len(context) - 1:len(ids) - 1]
    return (sum(rows[i, t].item() for i, t in enumerate(continuation)),
            all(int(rows[i].argmax()) == t for i, t in enumerate(continuation)))


def check_choices(samples, model64, tok):
    """lm-eval encodes a pair as context + continuation, a context's trailing
    whitespace moved to the continuation; an empty context is the prefix token
    (the tokenizer's BOS)."""
    greedy_seen = False
    for s in samples:
        for i, choice in enumerate(s["doc"]["choices"]):
            context, continuation = s["doc"]["question"], choice
            stripped = context.rstrip()
            context, continuation = stripped, context[len(stripped):] + continuation
            ctx = tok.encode(context) if context else [tok.bos_token_id]
            want, greedy = scored(model64, ctx, tok.encode(continuation))
            got, got_greedy = s["resps"][i][0]
            assert float(got) == pytest.approx(want, abs=TOL), (s["doc"], choice)
            assert got_greedy == str(greedy), (s["doc"], choice)
            greedy_seen |= greedy
    assert greedy_seen                      # the flag was tested both ways


def check_rolling(samples, model64, tok):
    """lm-eval's disjoint rolling windows of ``max_length - 1`` tokens, the
    first after the prefix token: each token scored once."""
    for s in samples:
        ids = tok.encode(s["doc"]["text"])
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=ids, prefix_token=tok.bos_token_id, max_seq_len=MAX_LEN - 2, context_len=1)]
        assert (len(windows) > 1) == (len(ids) > MAX_LEN - 2)
        want = sum(scored(model64, c, p)[0] for c, p in windows)
        assert float(s["resps"][0][0]) == pytest.approx(want, abs=TOL * len(windows)), s["doc"]
    assert len(ids) > MAX_LEN                # the last document needed several windows


@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_local_completions_log_likelihoods_equal_a_float64_recompute(server, tasks, offline, model64,
                                                                     tmp_path, backend):
    """``tokenizer_backend=huggingface`` loads the tokenizer from the folder
    ``/v1/models`` names as ``root``; ``remote`` asks the server's
    ``/tokenizer_info`` and ``/tokenize`` (and batches 4 prompts a request)."""
    card = server.model_card
    args = {"model": "tiny-py", "base_url": f"{server.url}/v1/completions", "tokenizer_backend": backend,
            "max_length": card["max_model_len"], "max_retries": 1, "num_concurrent": 4}
    extra = ()
    if backend == "huggingface":
        args["tokenizer"] = card["root"]
    else:
        args["num_concurrent"] = 1
        extra = ("--batch_size", "4")
    samples = lm_eval(server, tasks, tmp_path, "local-completions", args, *extra)
    tok = offline.tokenizer
    check_choices(samples["mbe_choice"], model64, tok)
    check_rolling(samples["mbe_rolling"], model64, tok)
    params = SamplingParams(max_tokens=GEN["max_gen_toks"], temperature=0, stop=("\n", "<|eos|>"))
    want = offline.generate([d["prompt"] for d in GEN_DOCS], params, use_tqdm=False)
    assert [s["resps"][0][0] for s in samples["mbe_gen"]] == [w.outputs[0].text for w in want]


def test_local_chat_completions_generate_the_offline_text(server, tasks, offline, tmp_path):
    """``local-chat-completions`` with ``--apply_chat_template`` sends each
    prompt as one user message; the server renders the model's chat template."""
    args = {"model": "tiny-py", "base_url": f"{server.url}/v1/chat/completions", "max_retries": 1,
            "num_concurrent": 2}
    samples = lm_eval(server, tasks, tmp_path, "local-chat-completions", args, "--apply_chat_template")
    render = load_chat_template(server.model_card["root"])
    prompts = [render([{"role": "user", "content": d["prompt"]}]) for d in GEN_DOCS]
    params = SamplingParams(max_tokens=GEN["max_gen_toks"], temperature=0, stop=tuple(GEN["until"]))
    want = offline.generate(prompts, params, use_tqdm=False)
    assert [s["resps"][0][0] for s in samples["mbe_gen"]] == [w.outputs[0].text for w in want]
