"""The chapters in JupyterLab (issue 29): the numbers and questions the site
shows, and opening or saving a chapter leaves its file as it was.

minibatch_engine.book.lab renders the glue, term, cite and ref roles from the
stored outputs (as Jupyter Book does); make lab serves the chapters through
minibatch_engine.book.lab_server.BookContentsManager. The last test opens a
chapter in a real JupyterLab with jupyterlab-myst (tools/check_lab.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minibatch_engine.book.lab import _ROLE, for_lab, format_plain_text, from_lab, glue_values

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "chapters").glob("[0-9]*.ipynb")) + [
    ROOT / "book" / "simulator_validation.ipynb", ROOT / "book" / "appendix_cpu_kernels.ipynb"]
BIB = ROOT / "book" / "references.bib"
IDS = [p.stem for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_file_is_what_nbformat_writes(path: Path):
    """Jupyter saves with nbformat: a committed notebook must already be in that
    form (indent, key order, nbformat 4.5 with cell ids), or saving it rewrites it."""
    text = path.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    assert (nb.nbformat, nb.nbformat_minor) == (4, 5)
    assert all("id" in c for c in nb.cells)
    assert nbformat.writes(nb) + "\n" == text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_lab_view_has_no_raw_roles_and_saves_back_to_the_file(path: Path):
    text = path.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    shown = for_lab(nb, where=path.parent, bib=BIB)
    for i, cell in enumerate(shown["cells"]):
        if cell["cell_type"] == "markdown":
            raw = re.findall(r"\{(?:glue|term|cite|ref)[^}]*\}`[^`]*`", cell["source"])
            assert not raw, f"cell {i}: {raw[:3]}"
    assert nbformat.writes(nbformat.from_dict(from_lab(shown))) + "\n" == text


def test_lab_values_are_the_sites():
    """Each glue role's text equals what myst_nb (the site's renderer) makes of it."""
    myst_nb = pytest.importorskip("myst_nb.core.variables")
    n = 0
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        values = glue_values(nb)
        for cell in nb.cells:
            if cell.cell_type != "markdown":
                continue
            for m in _ROLE.finditer(cell.source):
                if m.group(1) != "glue:text" or "::" in m.group(2):
                    continue
                key, _, spec = m.group(2).rpartition(":") if ":" in m.group(2) else (m.group(2), "", "s")
                assert format_plain_text(values[key], spec) == myst_nb.format_plain_text(values[key], spec)
                n += 1
    assert n > 500


def test_chapter_two_reads_its_numbers():
    nb = nbformat.read(ROOT / "chapters" / "02_static_batching.ipynb", as_version=4)
    values = glue_values(nb)
    text = "\n".join(c["source"] for c in for_lab(nb)["cells"] if c["cell_type"] == "markdown")
    gap = format_plain_text(values["gap_bimodal"], ".1f")
    assert f"{gap} points (bimodal)" in " ".join(text.split())
    assert "{glue" not in text


def test_an_edited_cell_keeps_the_edit_and_kernel_metadata_returns():
    nb = nbformat.read(ROOT / "chapters" / "02_static_batching.ipynb", as_version=4)
    shown = for_lab(nb, python_version="3.99.0")
    assert shown["metadata"]["language_info"]["version"] == "3.99.0"
    i = next(i for i, c in enumerate(shown["cells"]) if "minibatch_engine_lab" in c["metadata"])
    shown["cells"][i]["source"] = "my note"
    back = from_lab(shown)
    assert back["cells"][i]["source"] == "my note"
    assert "minibatch_engine_lab" not in back["cells"][i]["metadata"]
    assert back["metadata"] == nb.metadata


CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no browser at {CHROMIUM}")
def test_chapter_two_in_jupyterlab():
    """A real JupyterLab with jupyterlab-myst: rendered cells show no raw role,
    the notebook is not marked modified, saving it leaves the file unchanged."""
    pytest.importorskip("jupyterlab")
    pytest.importorskip("jupyterlab_myst")
    pytest.importorskip("playwright")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_lab.py"),
                           str(ROOT / "chapters" / "02_static_batching.ipynb"), "--chromium", CHROMIUM],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "dropdowns" in proc.stdout and " ok" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no browser at {CHROMIUM}")
def test_lab_with_the_venvs_settings_shows_no_news_pop_up(tmp_path: Path):
    """`make lab` installs tools/jupyterlab_overrides.json as the venv's
    share/jupyter/lab/settings/overrides.json. A copy of this venv's Lab
    application folder with that file: the settings API reports the override,
    and the "official Jupyter news" question never appears in the browser
    (without the file, JupyterLab's schema asks it: fetchNews "none")."""
    import json
    import shutil
    import socket
    import time
    import urllib.request
    pytest.importorskip("jupyterlab")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    installed = Path(sys.prefix) / "share" / "jupyter" / "lab"
    schema = installed / "schemas" / "@jupyterlab" / "apputils-extension" / "notification.json"
    assert json.loads(schema.read_text())["properties"]["fetchNews"]["default"] == "none"
    app = tmp_path / "lab"
    shutil.copytree(installed, app, ignore=shutil.ignore_patterns("settings"))
    (app / "settings").mkdir()
    shutil.copy(ROOT / "tools" / "jupyterlab_overrides.json", app / "settings" / "overrides.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JUPYTERLAB_DIR=str(app), JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "user"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           "--IdentityProvider.token=t", f"--ServerApp.root_dir={tmp_path}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token=t", timeout=2)
                break
            except OSError:
                assert time.time() < deadline and proc.poll() is None, "jupyter lab did not start"
                time.sleep(0.5)
        url = f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification?token=t"
        served = json.loads(urllib.request.urlopen(url).read())
        assert served["schema"]["properties"]["fetchNews"]["default"] == "false"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(f"{base}/lab?token=t")
            page.wait_for_selector("#jp-main-dock-panel", timeout=120_000)
            page.wait_for_timeout(8000)     # the question comes as a toast after start-up
            shown = page.inner_text("body")
            browser.close()
        assert "official Jupyter news" not in shown
    finally:
        proc.terminate()
        proc.wait(30)
