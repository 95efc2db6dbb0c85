"""The repository around the engine: Makefile targets, workflows, metadata files,
the architecture page. Fast checks (make -n, a fake pytest, file parsing)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
yaml = pytest.importorskip("yaml")

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``make`` as a reader runs it: without the variables an enclosing make
    (``make test TEST_EXTRAS=...`` running this suite) passes down in MAKEFLAGS."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "TEST_EXTRAS")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True,
                          text=True, env=env)


def phony_targets() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    return [t for line in re.findall(r"^\.PHONY:(.*)$", text, re.M) for t in line.split()]


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    """A VENV whose install stamp is up to date, so make runs no pip."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed").touch()
    (venv / ".test-installed").touch()
    (venv / ".lab-installed").touch()
    return venv


# --- Makefile ---------------------------------------------------------------

@needs_make
def test_make_help_lists_every_target():
    out = make("-s", "help")
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"^  ([a-z][a-z-]*)\s", out.stdout, re.M))
    missing = [t for t in phony_targets() if t not in listed]
    assert not missing, f"`make help` does not list: {missing}"
    # and every target it lists is a real one
    assert listed <= set(phony_targets()), listed - set(phony_targets())


@needs_make
def test_make_lab_passes_lab_args_and_allows_root(fake_venv: Path):
    out = make("-n", f"VENV={fake_venv}", "LAB_ARGS=--no-browser --port 8899", "lab")
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if "jupyter lab" in ln)
    assert "--no-browser --port 8899" in line
    assert ("--allow-root" in line) == (os.geteuid() == 0), line
    assert "pip install" not in out.stdout, "the lab extra is installed once (a stamp), not every call"


@needs_make
def test_make_install_uses_torch_index(tmp_path: Path):
    out = make("-n", f"VENV={tmp_path / 'new'}", f"TORCH_INDEX={CPU_INDEX}", "install")
    assert out.returncode == 0, out.stderr
    assert f"--index-url {CPU_INDEX}" in out.stdout
    assert "torch==" in out.stdout  # the pin stays the default


@needs_make
def test_make_nbval_names_each_notebook_and_fails_at_the_end(fake_venv: Path, tmp_path: Path):
    fake = tmp_path / "fakepy"
    fake.write_text('#!/bin/sh\necho "ran $*"\ncase "$*" in *bad*) echo "its traceback"; exit 1;; esac\n')
    fake.chmod(0o755)
    (fake_venv / "bin").mkdir()
    (fake_venv / "bin" / "python").symlink_to(fake)          # the kernels part runs it too
    nbs = "x/a.ipynb x/bad.ipynb x/c.ipynb book/appendix_cpu_kernels.ipynb"
    out = make("-s", f"VENV={fake_venv}", f"PY={fake}", f"NOTEBOOKS={nbs}", "nbval")
    assert out.returncode != 0
    lines = out.stdout.splitlines()
    for i, nb in enumerate(nbs.split(), 1):
        assert f"nbval [{i}/4] {nb}" in lines                   # each name as it starts
        assert any(ln.startswith(f"nbval [{i}/4] {nb}: ") and " s, " in ln for ln in lines)   # its time
    ran = [ln for ln in lines if "--nbval" in ln]                # one pytest per notebook:
    assert sorted(ln.split()[-1] for ln in ran) == sorted(nbs.split())
    assert [ln for ln in ran if ln.startswith("ran ")] == [ran[-1]], "only a failed log is shown whole"
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("nbval: seconds per notebook"))):]
    assert "then alone: book/appendix_cpu_kernels.ipynb" in table[0]
    assert sum(ln.strip().endswith(".ipynb") for ln in table) >= 4
    # the appendix (wall-clock timings) starts after every other notebook has ended
    alone = lines.index("nbval [4/4] book/appendix_cpu_kernels.ipynb")
    assert all(lines.index(next(ln for ln in lines if ln.startswith(f"nbval [{i}/4] {nb}: "))) < alone
               for i, nb in enumerate(nbs.split()[:3], 1))
    assert "its traceback" in lines, "a failed notebook's output is shown"
    assert lines[-1] == "nbval failed: x/bad.ipynb"


@needs_make
def test_make_nbval_starts_the_longest_notebooks_first(fake_venv: Path):
    """NBVAL_FIRST, in its order, before the others (in NOTEBOOKS' order); the
    ones run alone after the separator."""
    first = ["chapters/03_continuous_batching.ipynb", "chapters/12_many_engines.ipynb"]
    out = make("-n", f"VENV={fake_venv}", f"NBVAL_FIRST={' '.join(first)}",
               f"NOTEBOOKS=x/a.ipynb {first[1]} book/appendix_cpu_kernels.ipynb x/b.ipynb {first[0]}", "nbval")
    assert out.returncode == 0, out.stderr
    line = out.stdout.replace("\\\n", " ").splitlines()[-1]      # the recipe, its lines joined
    notebooks = line.split('" ')[-1].split()
    assert notebooks == [*first, "x/a.ipynb", "x/b.ipynb", "--", "book/appendix_cpu_kernels.ipynb"]


@needs_make
def test_make_test_runs_its_parts_in_turn_and_prints_their_times(tmp_path: Path):
    """The parts as TEST_PARTS lists them, a table of seconds after the last, and
    the table up to the part that failed when one fails."""
    (tmp_path / "Makefile").write_text(
        f"include {ROOT / 'Makefile'}\n"
        "a:\n\t@echo ran a\nb:\n\t@echo ran b\nc:\n\t@echo ran c\n\t@test -z '$(FAIL)'\nd:\n\t@echo ran d\n")
    parts = "TEST_PARTS=first=a second=b,c third=d"
    out = make("-s", parts, "test", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [ln for ln in lines if ln.startswith("ran ")] == ["ran a", "ran b", "ran c", "ran d"]
    i = lines.index("make test: seconds per part")
    assert [ln.split()[0] for ln in lines[i + 1:]] == ["first", "second", "third", "total"]
    assert all(ln.split()[1].isdigit() for ln in lines[i + 1:])
    out = make("-s", parts, "FAIL=1", "test", cwd=tmp_path)
    assert out.returncode != 0
    lines = out.stdout.splitlines()
    assert "ran d" not in lines
    i = lines.index("make test: seconds per part, up to the one that failed")
    assert [ln.split()[0] for ln in lines[i + 1:]] == ["first", "second", "total"]


# --- workflows ----------------------------------------------------------------

def workflow(name: str) -> dict:
    return yaml.safe_load((ROOT / ".github" / "workflows" / name).read_text())


@pytest.mark.parametrize("name", ["book.yml", "test.yml"])
def test_workflows_install_cpu_torch(name: str):
    wf = workflow(name)
    envs = [wf.get("env", {})] + [job.get("env", {}) for job in wf["jobs"].values()]
    assert any(e.get("TORCH_INDEX") == CPU_INDEX for e in envs), f"{name} must set TORCH_INDEX={CPU_INDEX}"


def test_test_workflow_runs_make_test():
    steps = workflow("test.yml")["jobs"]["test"]["steps"]
    runs = " ".join(s.get("run", "") for s in steps)
    assert ".ci/run" in runs or "make test" in runs


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sed") is None, reason="needs bash and sed")
def test_pages_workflow_points_links_at_its_repository(tmp_path: Path):
    steps = workflow("book.yml")["jobs"]["build"]["steps"]
    step = next(s for s in steps if "_config.yml" in s.get("run", ""))
    original = (ROOT / "_config.yml").read_text()
    (tmp_path / "_config.yml").write_text(original)
    env = dict(os.environ, GITHUB_SERVER_URL="https://github.com", GITHUB_REPOSITORY="someone/a-fork",
               GITHUB_REF_NAME="main")
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    new = (tmp_path / "_config.yml").read_text()
    cfg = yaml.safe_load(new)
    assert cfg["repository"] == {"url": "https://github.com/someone/a-fork", "branch": "main"}
    changed = [(a, b) for a, b in zip(original.splitlines(), new.splitlines()) if a != b]
    assert len(changed) <= 2 and all(a.startswith(("  url:", "  branch:")) for a, _ in changed), changed


# --- metadata files -----------------------------------------------------------

def pyproject_field(name: str) -> str:
    m = re.search(rf'^{name}\s*=\s*(?:\{{\s*text\s*=\s*)?"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert m, name
    return m.group(1)


def test_license_matches_pyproject():
    assert pyproject_field("license") == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_citation_cff():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    for key in ("cff-version", "message", "title", "authors"):
        assert cff.get(key), f"CITATION.cff needs {key}"
    assert cff["license"] == "MIT"
    assert str(cff["version"]) == pyproject_field("version")
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert cff["repository-code"] == config["repository"]["url"]


def test_gitignore():
    lines = (ROOT / ".gitignore").read_text().splitlines()
    for entry in ("build/", ".venv-setupcheck/", "_build/"):
        assert entry in lines, entry


# --- the architecture page ----------------------------------------------------------

def test_architecture_page_in_toc_and_linked():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [c["file"] for part in toc["parts"] for c in part["chapters"]]
    assert "book/architecture" in files
    assert "book/architecture.md" in (ROOT / "README.md").read_text()
    assert "{doc}`architecture`" in (ROOT / "book" / "intro.md").read_text()


def test_architecture_page_names_real_paths():
    """Every package path the page names exists: the page follows the code."""
    text = (ROOT / "book" / "architecture.md").read_text()
    paths = set(re.findall(r"`([a-z_]+/(?:[a-z_]+\.py)?|[a-z_]+\.py)`", text)) - {"minibatch_engine/"}
    assert len(paths) > 10
    missing = sorted(p for p in paths if not (ROOT / "minibatch_engine" / p).exists()
                     and not (p.startswith("tools/") and (ROOT / p).exists()))
    assert not missing, f"book/architecture.md names paths missing from minibatch_engine/ (or tools/): {missing}"



def test_architecture_page_names_each_folders_owner():
    """The page's "package at a glance" table has a row, with an owner, for every
    folder of the package, and the root holds at most three modules besides
    __init__.py (issue 43: the folders show the architecture)."""
    text = (ROOT / "book" / "architecture.md").read_text()
    table = text.split("## The package at a glance", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[2]
    package = ROOT / "minibatch_engine"
    folders = {p.name + "/" for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(rows), f"folders without a row: {sorted(folders - set(rows))}, " \
                                 f"rows without a folder: {sorted(set(rows) - folders)}"
    assert all(rows.values()), "every folder's row names its owner"
    root_modules = sorted(p.name for p in package.glob("*.py") if p.name != "__init__.py")
    assert len(root_modules) <= 3, root_modules

# --- the simulator's validation page (issue 26) ------------------------------------------------

def test_simulator_validation_page_is_in_the_book_and_rerun_by_nbval():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [c["file"] for part in toc["parts"] for c in part["chapters"]]
    assert "book/simulator_validation" in files
    assert "book/simulator_validation.ipynb" in (ROOT / "Makefile").read_text().split("NOTEBOOKS :=")[1].splitlines()[0]
    # the calibration data travels with its licence
    assert (ROOT / "data" / "gpu-profiles" / "LICENSE.vidur").is_file()


@needs_make
def test_make_book_installs_the_book_extra_and_make_test_the_test_extras(tmp_path: Path):
    """A lean install for reading (issue 29): `make install` (what `make book`
    runs) takes the book extra only; the test extras come with `make test`."""
    book = make("-n", f"VENV={tmp_path / 'new'}", "install")
    assert book.returncode == 0, book.stderr
    assert '-e ".[book]"' in book.stdout and "test" not in book.stdout.split("[book")[1].split('"')[0]
    test = make("-n", f"VENV={tmp_path / 'new'}", "unit")
    assert '-e ".[book,test]"' in test.stdout, test.stdout


def test_the_kernel_config_drops_only_the_unencrypted_tcp_warning():
    """tools/ipython_kernel_config.py (copied into the venv by the Makefile)
    silences ipykernel's loopback-TCP warning and nothing else."""
    import logging
    import runpy
    path = ROOT / "tools" / "ipython_kernel_config.py"
    assert "$(KERNEL_CFG)" in (ROOT / "Makefile").read_text()
    log, seen = logging.getLogger("IPKernelApp"), []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    handler, before = Keep(), list(log.filters)
    log.addHandler(handler)
    try:
        runpy.run_path(str(path))
        log.warning("Kernel is running over TCP without encryption. All communication ...")
        log.warning("something else")
    finally:
        log.removeHandler(handler)
        log.filters[:] = before
    assert seen == ["something else"]


# --- JupyterLab's settings for `make lab` (issue 39) -------------------------------------------

LAB_OVERRIDES = ROOT / "tools" / "jupyterlab_overrides.json"


@needs_make
def test_make_lab_installs_the_lab_settings_overrides(fake_venv: Path):
    """`make lab` (and `make check-lab`) copy tools/jupyterlab_overrides.json to
    the venv's JupyterLab settings, where Lab reads overrides.json."""
    for target in ("lab", "check-lab"):
        out = make("-n", f"VENV={fake_venv}", target)
        assert out.returncode == 0, out.stderr
        dest = fake_venv / "share" / "jupyter" / "lab" / "settings" / "overrides.json"
        assert f"install -D -m 644 tools/jupyterlab_overrides.json {dest}" in out.stdout, out.stdout


def test_lab_overrides_turn_off_the_news_pop_up_and_match_jupyterlabs_schema():
    """The overrides say "never" to the news pop-up, and every key is a real
    setting of the installed JupyterLab whose value its schema accepts."""
    import json
    import sys
    overrides = json.loads(LAB_OVERRIDES.read_text())
    plugin = "@jupyterlab/apputils-extension:notification"
    assert overrides[plugin]["fetchNews"] == "false"
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("jupyterlab")
    schemas = Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas"
    for name, values in overrides.items():
        package, file = name.split(":")
        schema_file = schemas / package / f"{file}.json"
        assert schema_file.is_file(), f"{name}: no schema {schema_file} in this JupyterLab"
        properties = json.loads(schema_file.read_text())["properties"]
        for key, value in values.items():
            assert key in properties, f"{name} has no setting {key!r}"
            jsonschema.validate(value, properties[key])


def test_jupyterlab_server_reads_the_overrides_file(tmp_path: Path):
    """jupyterlab_server, given the settings folder the Makefile fills, finds
    the override (what Lab then uses as the setting's default)."""
    settings_utils = pytest.importorskip("jupyterlab_server.settings_utils")
    shutil.copy(LAB_OVERRIDES, tmp_path / "overrides.json")
    found, error = settings_utils._get_overrides(str(tmp_path))
    assert not error, error
    assert found["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
