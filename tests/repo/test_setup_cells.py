"""Each chapter's setup cell runs with only the package's base install + Jupyter.

That is what a reader of a hosted notebook (Colab, Binder) or of a plain
`pip install minibatch-engine` has: the dependencies in pyproject.toml's
``[project] dependencies`` and a kernel, none of the ``[book]`` extra (no
jupyter-book, no myst_nb). The book's own environment (.venv) has all of it,
so it cannot tell; this test builds a second virtualenv that has only that:

    python -m venv .venv-setupcheck
    torch: this venv's own files, hard-linked (a CPU build, no TORCH_INDEX), or
        pip install torch==<the version in this venv>  (TORCH_INDEX, if set, as --index-url)
    pip install -e . ipykernel nbclient             (base dependencies only, no extras)

once, and keeps it (gitignored) until the package's dependencies (pyproject.toml's
``[project] dependencies`` and ``[build-system] requires``), the torch version or
TORCH_INDEX change: an edit elsewhere in pyproject.toml keeps it. Hard links
give the same files pip would unpack from the same wheel, byte-compiled, in
about a second instead of half a minute; pip still resolves and installs
torch's own dependencies with the rest. Building it takes about half a minute
on two busy cores; all thirteen setup cells then run in one kernel in about
ten seconds. The check needs no
GPU: on a CUDA machine, run
`make test TORCH_INDEX=https://download.pytorch.org/whl/cpu` (make passes it
on to this test) so that this venv gets the small CPU build of torch; without
it pip takes the same torch release from PyPI (a CUDA build on Linux, served
from pip's cache when .venv got the same one). For every chapter notebook it runs
the first code cell in a fresh kernel of that environment, in chapters/, and
reports the notebook, the cell and the error.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK_VENV = ROOT / ".venv-setupcheck"
NOTEBOOKS = sorted((ROOT / "chapters").glob("[0-9]*.ipynb"))
# the book-only packages that must NOT be importable there
BOOK_ONLY = ["myst_nb", "jupyter_book", "nbval"]

pytestmark = pytest.mark.slow

# Runs inside the check environment: every chapter's first code cell, in one
# kernel (a kernel and torch start once, not once a chapter). `%reset -f` before
# each clears the names the cells before it defined, so a cell that uses a name
# it does not define still fails; modules stay imported, which hides nothing: a
# module the base install lacks fails to import whichever cell asks first.
RUNNER = textwrap.dedent(
    """
    import json, sys
    import nbformat
    from nbclient import NotebookClient

    cells, found = [], []
    for path in sys.argv[2:]:
        nb = nbformat.read(path, as_version=4)
        index = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        cell = nb.cells[index]
        # after the cell, a probe reports which Python the kernel runs (this venv's)
        cells += [nbformat.v4.new_code_cell("%reset -f"), cell,
                  nbformat.v4.new_code_cell("import sys; print(sys.prefix)")]
        found.append((path, index, cell.source))
    one = nbformat.v4.new_notebook(cells=cells, metadata=nb.metadata)
    NotebookClient(one, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": sys.argv[1]}}).execute()
    results = {}
    for k, (path, index, source) in enumerate(found):
        cell, probe = one.cells[3 * k + 1], one.cells[3 * k + 2]
        errors = [o for o in cell.outputs if o.output_type == "error"]
        result = {"index": index, "source": source}
        if errors:
            result.update(ok=False, ename=errors[0].ename, evalue=errors[0].evalue)
        else:
            text = "".join(o.get("text", "") for o in probe.outputs)
            result.update(ok=True, prefix=text.strip())
        results[path] = result
    print("SETUPCHECK " + json.dumps(results))
    """
)


def _bin(name: str) -> Path:
    sub = "Scripts" if os.name == "nt" else "bin"
    return CHECK_VENV / sub / name


def _clean_env() -> dict[str, str]:
    """The environment of a fresh shell in the check venv: nothing inherited
    from the book's venv or from PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "JUPYTER_PATH")}
    env["VIRTUAL_ENV"] = str(CHECK_VENV)
    env["PATH"] = str(_bin("python").parent) + os.pathsep + env.get("PATH", "")
    return env


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=_clean_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RuntimeError(f"building {CHECK_VENV.name}: {what} failed (exit {proc.returncode}):\n"
                           f"$ {' '.join(cmd)}\n{tail}")


def _dependencies() -> str:
    """What the base install depends on: ``[project] dependencies`` and
    ``[build-system] requires`` (the whole pyproject.toml where no TOML reader)."""
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:                       # Python 3.10
        return text
    data = tomllib.loads(text)
    return json.dumps([data["project"].get("dependencies", []), data["build-system"].get("requires", [])])


def _link_torch() -> bool:
    """Hard-link this venv's torch (its packages and its dist-info, as its RECORD
    lists them) into the check venv's site-packages; False where a link fails
    (another file system), after removing what was linked."""
    import shutil
    from importlib.metadata import distribution

    dist = distribution("torch")
    source = Path(dist.locate_file(""))
    tops = sorted({Path(f).parts[0] for f in dist.files if Path(f).parts[0] != ".."})
    dest = Path(subprocess.run([str(_bin("python")), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               env=_clean_env(), capture_output=True, text=True, check=True).stdout.strip())
    try:
        for top in tops:
            if (source / top).is_dir():
                shutil.copytree(source / top, dest / top, copy_function=os.link)
            else:
                os.link(source / top, dest / top)
    except OSError:
        for top in tops:
            shutil.rmtree(dest / top, ignore_errors=True)
            (dest / top).unlink(missing_ok=True)
        return False
    return True


@pytest.fixture(scope="session")
def check_python() -> Path:
    import torch

    torch_version = torch.__version__.split("+")[0]
    torch_index = os.environ.get("TORCH_INDEX", "")
    key = hashlib.sha256(f"{_dependencies()}|{torch_version}|{torch_index}|{sys.version_info[:2]}"
                         .encode()).hexdigest()
    stamp = CHECK_VENV / ".setupcheck-key"
    py = _bin("python")
    with open(ROOT / ".venv-setupcheck.lock", "w") as lock:
        if os.name != "nt":
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)      # another pytest process may be building it
        if not (py.exists() and stamp.exists() and stamp.read_text() == key):
            if CHECK_VENV.exists():
                import shutil

                shutil.rmtree(CHECK_VENV)
            _run([sys.executable, "-m", "venv", str(CHECK_VENV)], "python -m venv")
            pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            if torch_index or torch.version.cuda is not None or not _link_torch():
                _run(pip + [f"torch=={torch_version}"] + (["--index-url", torch_index] if torch_index else []),
                     "installing torch")
            _run(pip + ["-e", str(ROOT), "ipykernel", "nbclient"], "installing the package (base install)")
            stamp.write_text(key)
    # the point of the exercise: the book's extras are absent
    probe = subprocess.run(
        [str(py), "-c", "import importlib.util, json, sys; "
                        f"print(json.dumps([m for m in {BOOK_ONLY!r} if importlib.util.find_spec(m)]))"],
        cwd=ROOT, env=_clean_env(), capture_output=True, text=True, check=True)
    leaked = json.loads(probe.stdout)
    assert not leaked, f"{CHECK_VENV.name} must have only the base install, but it has {leaked}"
    return py


@pytest.fixture(scope="session")
def setup_results(check_python: Path) -> dict:
    """Each chapter's setup cell run in the check venv: {notebook path: result}."""
    chapters = NOTEBOOKS[0].parent
    proc = subprocess.run([str(check_python), "-c", RUNNER, str(chapters), *map(str, NOTEBOOKS)],
                          cwd=chapters, env=_clean_env(), capture_output=True, text=True,
                          timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SETUPCHECK ")]
    if not lines:
        pytest.fail(f"could not run the setup cells in {CHECK_VENV.name} "
                    f"(exit {proc.returncode}):\n{proc.stderr.strip()[-3000:]}")
    return json.loads(lines[-1][len("SETUPCHECK "):])


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[nb.stem for nb in NOTEBOOKS])
def test_setup_cell_runs_with_base_install(setup_results: dict, notebook: Path):
    result = setup_results[str(notebook)]
    if result["ok"]:
        assert Path(result["prefix"]).resolve() == CHECK_VENV.resolve(), (
            f"{notebook.name}: the kernel ran in {result['prefix']}, not in {CHECK_VENV}")
    if not result["ok"]:
        first = "\n".join("    " + ln for ln in result["source"].splitlines()[:12])
        pytest.fail(
            f"{notebook.relative_to(ROOT)}: its setup cell (notebook cell {result['index']}, the first "
            f"code cell) fails with only `pip install minibatch-engine` + Jupyter:\n"
            f"  {result['ename']}: {result['evalue']}\n  the cell begins:\n{first}",
            pytrace=False)
