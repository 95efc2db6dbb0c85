"""What ``make gpu-check`` found (``tools/gpu_check.py`` writes ``gpu_check.json``),
read back for chapter 10: whether the book's CUDA code has run on a GPU, the
run's provenance and its decode measurements. Without the file, every function
says so: the CUDA paths (the Triton kernel on CUDA, CUDA graphs, the side-stream
swap) then count as untested on a GPU."""
from __future__ import annotations

import json
from pathlib import Path

DECODE_COLUMNS = ["batch", "CUDA graphs", "step ms", "tok/s", "GB/s", "of HBM peak"]


def read_gpu_check(path: str | Path) -> dict | None:
    """The report, or None when no GPU check has been committed."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else None


def gpu_status(report: dict | None) -> str:
    """One sentence: has this code run on a GPU, and where."""
    if report is None:
        return ("No GPU has run this book's CUDA code yet (the repository has no "
                "gpu_check.json): the Triton kernels (paged and split-KV), the CUDA graphs "
                "and the side-stream swap are untested on a GPU")
    m, tests = report["machine"], report.get("cuda_tests", {})
    return (f"make gpu-check has run this book's CUDA code on a GPU ({m['gpu']}, "
            f"{m['date_utc']}, commit {str(m['git_commit'])[:10]}): {tests.get('passed')} CUDA "
            f"tests passed and {tests.get('failures')} failed")


def gpu_status_short(report: dict | None) -> str:
    """A few words for a list item: tested on a GPU or not."""
    if report is None:
        return "untested on a GPU until make gpu-check has run and its gpu_check.json is committed"
    return f"run on a GPU by make gpu-check ({report['machine']['gpu']})"


def gpu_check_lines(report: dict) -> list[str]:
    """Provenance, test counts, the Triton check and any failed decode run."""
    m = report["machine"]
    tests, check = report.get("cuda_tests", {}), report.get("triton_check", {})
    lines = [f"{m['gpu']}, driver {m['driver']}, torch {m['torch']}, triton {m['triton']}, "
             f"{m['date_utc']}, commit {str(m['git_commit'])[:10]}",
             f"CUDA tests: {tests.get('passed')} passed, {tests.get('failures')} failed",
             f"Triton vs reference ({check.get('dtype')}): max |error| {check.get('max_abs_error')}"]
    lines += [f"decode at batch {d['batch']} failed: {d['error']}" for d in report["decode"] if "error" in d]
    return lines


def decode_rows(report: dict) -> list[list]:
    """One row per decode measurement (see :data:`DECODE_COLUMNS`)."""
    return [[d["batch"], "on" if d["cuda_graphs"] else "off", d["median_step_ms"],
             d["output_tokens_per_s"], d["achieved_GBps"], d.get("hbm_roofline_fraction", float("nan"))]
            for d in report["decode"] if "error" not in d]
