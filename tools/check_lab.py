#!/usr/bin/env python3
"""Open chapters in a real JupyterLab (as `make lab` starts it) in headless
Chromium and check that they read as on the site.

Usage: python tools/check_lab.py [NOTEBOOK ...]   (default: chapter 2)

For each notebook (a copy, in a temporary folder): JupyterLab with the `lab`
extra (jupyterlab-myst) and minibatch_engine.book.lab_server.BookContentsManager
opens it; every markdown cell is rendered; the check fails when

* a rendered markdown cell still shows a raw role (``{glue``, ``{term}``,
  ``{cite}``, ``{ref}``) or a dropdown directive (`` ```{dropdown} ``);
* the notebook is marked modified (dirty) after opening and starting its kernel;
* saving it unchanged (Ctrl+S) changes the file.

Needs jupyterlab, jupyterlab-myst, playwright and Chromium (/usr/bin/chromium,
or $CHROMIUM). Prints one line per notebook; exit status 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from headless import CHROMIUM_ARGS, VIEWPORT

ROOT = Path(__file__).resolve().parents[1]
RAW = ["{glue", "{term}", "{cite}", "{ref}", "{dropdown}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(folder: Path, port: int, token: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
           "--ip=127.0.0.1", f"--IdentityProvider.token={token}",
           "--ServerApp.contents_manager_class="
           "minibatch_engine.book.lab_server.BookContentsManager",
           "--LabApp.news_url=", "--LabApp.check_for_updates_class="
           "jupyterlab.NeverCheckForUpdate", f"--ServerApp.root_dir={folder}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JUPYTER_CONFIG_DIR=str(folder / ".jupyter"))
    proc = subprocess.Popen(cmd, cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/api/status?token={token}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("jupyter lab exited:\n" + proc.stdout.read())
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("jupyter lab did not start in 120 s")


PROBE = r"""
async () => {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
  const scroller = panel.querySelector('.jp-WindowedPanel-outer') || panel.querySelector('.jp-Notebook');
  // scroll through the notebook so that every cell is attached and rendered
  for (let y = 0; y <= scroller.scrollHeight; y += 600) { scroller.scrollTop = y; await sleep(60); }
  await sleep(500);
  const cells = Array.from(panel.querySelectorAll('.jp-MarkdownCell'));
  const texts = cells.map((c) => (c.querySelector('.jp-RenderedMarkdown, .jp-RenderedMySTMarkdown, .myst') || c).innerText);
  return {cells: cells.length, texts,
          details: panel.querySelectorAll('.jp-MarkdownCell details, .jp-MarkdownCell .myst-dropdown').length};
}
"""


def first_difference(a: bytes, b: bytes) -> str:
    la, lb = a.decode().splitlines(), b.decode().splitlines()
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}: {x.strip()[:80]!r} -> {y.strip()[:80]!r}"
    return f"{len(la)} lines -> {len(lb)} lines"


def check(nb: Path, chromium: str, wait_kernel_s: float = 8.0) -> list[str]:
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / ".jupyter").mkdir()
        copy = folder / nb.name
        shutil.copyfile(nb, copy)
        before = copy.read_bytes()
        port, token = free_port(), "check-lab"
        lab = start_lab(folder, port, token)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport=VIEWPORT)
                page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(
                    (f"http://127.0.0.1:{port}", "data:", "blob:")) else r.abort())
                page.goto(f"http://127.0.0.1:{port}/lab/tree/{nb.name}?token={token}",
                          timeout=120_000)
                page.wait_for_selector(".jp-NotebookPanel .jp-MarkdownCell", timeout=120_000)
                # the kernel starts and reports its spec and language: what marks a notebook dirty
                page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                                       ".jp-KernelStatus-success", timeout=120_000, state="attached")
                page.wait_for_timeout(wait_kernel_s * 1000)
                out = page.evaluate(PROBE)
                for i, text in enumerate(out["texts"]):
                    for raw in RAW:
                        if raw in text:
                            at = text.index(raw)
                            problems.append(f"markdown cell {i + 1} shows {raw!r}: "
                                            f"{text[max(0, at - 40):at + 60]!r}")
                tab = page.query_selector(f".lm-TabBar-tab[data-type='document-title'] >> text={nb.name}")
                dirty = page.evaluate("() => !!document.querySelector('.lm-TabBar-tab.jp-mod-dirty')")
                if dirty:
                    problems.append("the notebook is marked modified after opening")
                page.keyboard.press("Control+s")
                page.wait_for_timeout(3000)
                if copy.read_bytes() != before:
                    problems.append("saving it unchanged changed the file: "
                                    + first_difference(before, copy.read_bytes()))
                print(f"{nb}: {out['cells']} markdown cells, {out['details']} dropdowns, "
                      f"{'ok' if not problems else f'FAIL ({len(problems)})'}", flush=True)
                del tab
                browser.close()
        finally:
            lab.terminate()
            try:
                lab.wait(timeout=20)
            except subprocess.TimeoutExpired:
                lab.kill()
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", default=[str(ROOT / "chapters" / "02_static_batching.ipynb")])
    ap.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    args = ap.parse_args(argv)
    failed = 0
    for nb in args.notebooks:
        problems = check(Path(nb).resolve(), args.chromium)
        for msg in problems:
            print(f"  - {msg}")
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
