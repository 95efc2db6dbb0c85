"""guidellm (the vLLM project's load generator, from PyPI) runs a sweep against
``serve --model tiny-py`` offline, its tokenizer loaded from the folder
``/v1/models`` names as ``root`` (issue 41, item 8). Skipped when guidellm is
not installed; a few requests per profile, on loopback, about a minute here (most
of it guidellm's worker processes starting)."""
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow          # make test-slow
pytest.importorskip("aiohttp")
pytest.importorskip("prometheus_client")
GUIDELLM = shutil.which("guidellm") or str(Path(sys.executable).with_name("guidellm"))
if not Path(GUIDELLM).is_file():
    pytest.skip("guidellm is not installed (the clients extra: make test-clients)", allow_module_level=True)

from minibatch_engine.entrypoints.server import ServerThread, make_app  # noqa: E402

REQUESTS = 4


def test_guidellm_sweep_against_serve_tiny_py(tmp_path):
    app = make_app("tiny-py", device="cpu", attention_backend="sdpa", max_num_seqs=16, max_model_len=512)
    with ServerThread(app) as s:
        with urllib.request.urlopen(f"{s.url}/v1/models") as r:
            root = json.loads(r.read())["data"][0]["root"]
        out = tmp_path / "guidellm.json"
        cmd = [GUIDELLM, "run", "--backend", f"kind=openai_http,target={s.url},model=tiny-py",
               "--tokenizer", f"kind=huggingface_auto,model={root}",
               "--profile", "kind=sweep,sweep_size=3",
               "--constraint", f"kind=max_requests,count={REQUESTS}",
               "--constraint", "kind=max_duration,seconds=30",
               "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
               "--output", f"kind=json,path={out}", "--disable-progress"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    benchmarks = json.loads(out.read_text())["benchmarks"]
    assert len(benchmarks) == 3                     # synchronous, throughput, one rate between
    for b in benchmarks:
        assert b["metrics"]["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                       "total": REQUESTS}
