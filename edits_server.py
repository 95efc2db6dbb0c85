"""Re-appliable notebook edits of the server issue (vLLM's RequestOutput shape:
``out.outputs[i]`` replaces ``out.text``/``out.token_ids``/``out.samples``).
Run from the repository root; running it twice changes nothing the second time."""
import json
import sys

EDITS = {
    "chapters/01_prefill_decode_kv_cache.ipynb": [
        ('out = llm_py.generate(["def "], params_py, use_tqdm=False)[0]\n',
         'out = llm_py.generate(["def "], params_py, use_tqdm=False)[0].outputs[0]\n'),
        ("cached_tokens = llm_py.generate([prompt], params, use_tqdm=False)[0].token_ids",
         "cached_tokens = llm_py.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids"),
    ],
    "chapters/04_paged_attention.ipynb": [
        ("return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]",
         "return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]"),
        ('for k, s in enumerate(out.samples):\n    print(f"sample {k}: {s[:10]} ...")',
         'for s in out.outputs:\n    print(f"sample {s.index}: {s.token_ids[:10]} ...")'),
    ],
}


def apply(path: str, edits) -> None:
    with open(path) as f:
        nb = json.load(f)
    for old, new in edits:
        cells = [c for c in nb["cells"] if old in "".join(c["source"])]
        done = [c for c in nb["cells"] if new in "".join(c["source"])]
        if not cells:
            if done:
                continue                      # applied before
            sys.exit(f"{path}: not found: {old[:60]!r}")
        if len(cells) > 1:
            sys.exit(f"{path}: found {len(cells)} times: {old[:60]!r}")
        src = "".join(cells[0]["source"]).replace(old, new)
        cells[0]["source"] = src.splitlines(keepends=True)
    with open(path, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


def refresh_source_output(path: str, cell_source: str, obj: str) -> None:
    """A cell that only prints ``inspect.getsource(obj)``: store the source as it is
    now (what re-executing that cell prints), without re-running the chapter."""
    import importlib
    import inspect
    module, _, attr = obj.rpartition(":")
    target = importlib.import_module(module)
    for part in attr.split("."):
        target = getattr(target, part)
    text = inspect.getsource(target)
    with open(path) as f:
        nb = json.load(f)
    cells = [c for c in nb["cells"] if "".join(c["source"]).strip() == cell_source]
    if len(cells) != 1:
        sys.exit(f"{path}: {len(cells)} cells are {cell_source!r}")
    cells[0]["outputs"] = [{"name": "stdout", "output_type": "stream",
                            "text": (text + "\n").splitlines(keepends=True)}]
    with open(path, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    for path, edits in EDITS.items():
        apply(path, edits)
    # chapter 8 prints AsyncLLM._run, which now reports each step to the stat loggers
    refresh_source_output("chapters/08_serving_under_load.ipynb", "print(inspect.getsource(AsyncLLM._run))",
                          "minibatch_engine.async_llm:AsyncLLM._run")
