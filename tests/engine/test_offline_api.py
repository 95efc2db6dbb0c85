"""vLLM's offline API shape: ``RequestOutput.outputs[i]`` (``CompletionOutput``),
stop strings, and vLLM's own basic example run with its import and model changed."""
import runpy
from pathlib import Path

from minibatch_engine import LLM, CompletionOutput, RequestOutput, SamplingParams, reference_generate

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "basic.py"


def test_vllm_basic_example_runs_with_only_its_import_and_model_changed(capsys):
    code = EXAMPLE.read_text()
    assert "from minibatch_engine import LLM, SamplingParams" in code and 'LLM(model="tiny-py")' in code
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert out.count("Prompt:    ") == 4 and "'The capital of France is'" in out


def test_request_output_has_vllms_fields(tiny64):
    llm = LLM(tiny64, max_num_seqs=4)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, n=2, ignore_eos=True), use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and out.finished and out.request_id == "0"
    assert out.prompt is None and out.prompt_token_ids == [1, 2, 3]
    assert all(isinstance(c, CompletionOutput) for c in out.outputs) and [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids == reference_generate(tiny64, [1, 2, 3], 5)
    assert out.outputs[0].finish_reason == "length" and isinstance(out.outputs[0].text, str)
    shown = repr(out)       # one readable line: each sample's text, not the metrics' lists
    assert "metrics" not in shown and "itl_steps" not in shown and "1: " in shown
    assert repr(out.outputs[1].text) in shown and "(length, 5 tokens)" in shown


def test_a_stop_string_cuts_text_and_tokens(tiny64):
    llm = LLM(tiny64, max_num_seqs=2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    full = llm.generate(["abc"], params, use_tqdm=False)[0].outputs[0]
    stop = full.text[3:5]                 # two characters the greedy text will produce
    cut = llm.generate(["abc"], SamplingParams(max_tokens=12, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < len(full.token_ids)
