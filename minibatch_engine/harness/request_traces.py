"""Production request traces replayed as workloads: each row of a CSV is one
request, with its arrival time and its prompt and output lengths in tokens.

Two traces ship with the package (``harness/traces/``, with their README and
licence): Azure's LLM inference traces of 2023, one hour of a conversation
service (``"azure-conv"``, 19,366 requests) and one of a coding assistant
(``"azure-code"``, 8,819), published with Splitwise (Patel et al., ISCA 2024)
in the processed form of the Vidur simulator (MIT). Any CSV with the columns
``arrived_at,num_prefill_tokens,num_decode_tokens`` replays the same way.

A replay keeps the trace's lengths and its arrival order exactly:

* a *window* (:meth:`RequestTrace.window`) keeps the requests that arrived in
  ``[start, start + duration)`` trace seconds, re-based so the window opens at 0 s;
* :meth:`RequestTrace.with_poisson_arrivals` keeps the requests and draws
  Poisson arrivals at their mean rate, the synthetic baseline to compare with;
* a *time scale* ``x`` divides every arrival time, and so every gap, by ``x``:
  the same requests ``x`` times faster, at ``x`` times the rate;
* prompts become seeded random token ids of the trace's lengths (the traces
  carry no text); outputs are exactly the trace's lengths (``max_tokens`` with
  ``ignore_eos``, as every workload here).

A request longer than the engine's ``max_model_len`` (prompt + output) is
refused by default, naming its CSV line; ``clip=True`` shortens its prompt
(and its output, if the output alone does not fit) instead.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .workload import RequestSpec

TRACE_DIR = Path(__file__).resolve().parent / "traces"
TRACE_FILES = {"azure-conv": "azure_conv_2023.csv", "azure-code": "azure_code_2023.csv"}
COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")


@dataclass(frozen=True, eq=False)
class RequestTrace:
    """Requests in arrival order: ``arrivals`` (seconds), ``prompt_lens`` and
    ``output_lens`` (tokens), ``lines`` (each row's line in its CSV, for
    messages). ``duration``: the span the trace covers, in seconds (a window's
    length, else the last arrival); ``name``: a label for reports."""
    name: str
    arrivals: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    lines: np.ndarray
    duration: float

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def rate(self) -> float:
        """Mean arrival rate over :attr:`duration`, requests per second."""
        return len(self) / self.duration if self.duration > 0 else float("inf")

    def window(self, start: float = 0.0, duration: float | None = None) -> "RequestTrace":
        """The requests that arrived in ``[start, start + duration)`` (to the end
        when ``duration`` is None), their arrivals minus ``start``."""
        if not (math.isfinite(start) and start >= 0):
            raise ValueError(f"trace start must be a finite number of seconds >= 0, got {start!r}")
        if duration is not None and not (math.isfinite(duration) and duration > 0):
            raise ValueError(f"trace duration must be a finite number of seconds > 0, got {duration!r}")
        end = math.inf if duration is None else start + duration
        keep = (self.arrivals >= start) & (self.arrivals < end)
        if not keep.any():
            raise ValueError(f"trace {self.name}: no request arrived in [{start:g}, {end:g}) s "
                             f"(its arrivals span 0 to {self.arrivals[-1]:g} s)")
        span = (self.duration - start) if duration is None else duration
        label = self.name if (start, duration) == (0.0, None) else f"{self.name} [{start:g}, {end:g}) s"
        return RequestTrace(label, self.arrivals[keep] - start, self.prompt_lens[keep], self.output_lens[keep],
                            self.lines[keep], max(span, float(self.arrivals[keep][-1] - start)))


    def with_poisson_arrivals(self, seed: int = 0) -> "RequestTrace":
        """The same requests, lengths and order, at seeded Poisson arrivals of
        the same mean rate over the same span: what a synthetic benchmark sends.
        Replaying both separates what the trace's lengths do from what its
        bursts do."""
        gaps = np.random.default_rng(seed).exponential(1.0 / self.rate, len(self))
        arrivals = np.cumsum(gaps) - gaps[0]
        return RequestTrace(f"{self.name}, Poisson arrivals", arrivals, self.prompt_lens, self.output_lens,
                            self.lines, max(self.duration, float(arrivals[-1])))


def trace_path(name_or_path: str | Path) -> Path:
    """The CSV of a shipped trace (``"azure-conv"``, ``"azure-code"``), or the path given."""
    if isinstance(name_or_path, str) and name_or_path in TRACE_FILES:
        return TRACE_DIR / TRACE_FILES[name_or_path]
    return Path(name_or_path)


def load_trace(name_or_path: str | Path) -> RequestTrace:
    """Read a trace CSV (a shipped trace's name, or a path). The header must
    name the three :data:`COLUMNS` (in any order; other columns are ignored);
    arrival times are seconds >= 0 that never decrease; token counts are whole
    numbers >= 1 (``"129.0"`` is read as 129). An error names the file, the
    line and the column."""
    path = trace_path(name_or_path)
    try:
        f = open(path, newline="")
    except FileNotFoundError:
        known = ", ".join(TRACE_FILES)
        raise ValueError(f"trace {path}: no such file (shipped traces: {known})") from None
    with f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}, line 1: the header {','.join(header) or '(empty)'} lacks the "
                             f"column(s) {', '.join(missing)}; a trace needs {','.join(COLUMNS)}")
        cols = [header.index(c) for c in COLUMNS]
        rows, lines = [], []
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            line = reader.line_num
            rows.append(_parse_row(path, line, row, cols, rows[-1][0] if rows else 0.0))
            lines.append(line)
    if not rows:
        raise ValueError(f"{path}: no requests after the header")
    a = np.array(rows, dtype=float)
    name = next((k for k, v in TRACE_FILES.items() if trace_path(k) == path), path.name)
    return RequestTrace(name, a[:, 0], a[:, 1].astype(int), a[:, 2].astype(int), np.array(lines),
                        float(a[-1, 0]))


def _parse_row(path, line: int, row: list[str], cols: list[int], previous: float) -> tuple[float, int, int]:
    out = []
    for col, i in zip(COLUMNS, cols):
        where = f"{path}, line {line}, column {col}"
        if i >= len(row):
            raise ValueError(f"{where}: missing (the row has {len(row)} fields)")
        try:
            x = float(row[i])
        except ValueError:
            raise ValueError(f"{where}: {row[i]!r} is not a number") from None
        if col == "arrived_at":
            if not (math.isfinite(x) and x >= previous):
                raise ValueError(f"{where}: {row[i]!r} must be a finite time in seconds >= 0 and >= "
                                 f"the row before's ({previous:g}): rows come in arrival order")
        elif not (math.isfinite(x) and x >= 1 and x == int(x)):
            raise ValueError(f"{where}: {row[i]!r} must be a whole number of tokens >= 1")
        out.append(x)
    return out[0], int(out[1]), int(out[2])


@dataclass(frozen=True, eq=False)
class TraceWorkload:
    """A trace (already windowed) as a workload for :func:`~minibatch_engine.harness.workload.make_workload`
    (and so for ``bench``, ``simulate`` and ``sweep``). ``time_scale``: arrivals
    that many times faster. ``clip``: shorten requests longer than
    ``max_model_len`` instead of refusing them. ``max_model_len``: the limit
    when the caller knows it before the engine exists (the engine's, passed to
    :meth:`make_requests`, wins)."""
    trace: RequestTrace
    time_scale: float = 1.0
    clip: bool = False
    max_model_len: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time scale must be a finite number > 0, got {self.time_scale!r}")

    def __str__(self) -> str:
        scale = "" if self.time_scale == 1 else f", time x{self.time_scale:g}"
        return f"{self.trace.name}{scale} ({self.rate:.3g} req/s mean)"

    @property
    def rate(self) -> float:
        """The replay's mean arrival rate: the trace's times the time scale (requests/s)."""
        return self.trace.rate * self.time_scale

    def make_requests(self, num_requests: int | None = None, seed: int = 0, vocab_size: int = 256,
                      arrival_rate: float | None = None, max_model_len: int | None = None) -> list[RequestSpec]:
        """The first ``num_requests`` requests of the trace (all when None), in
        arrival order, with prompts of seeded random token ids in
        ``[0, vocab_size)``. ``arrival_rate`` replaces the time scale by the one
        that brings the replayed requests' mean rate to it (what a sweep's
        rates mean for a trace): the whole trace's, or for the first ``n`` of
        it, ``n`` over the arrival time of the next one, so that a dense start
        is not replayed faster than the rate asked."""
        t = self.trace
        n = len(t) if num_requests is None else num_requests
        if not 1 <= n:
            raise ValueError(f"num_requests must be >= 1, got {num_requests}")
        n = min(n, len(t))
        replayed = t.rate if n == len(t) or t.arrivals[n] <= 0 else n / float(t.arrivals[n])
        scale = self.time_scale if arrival_rate is None else arrival_rate / replayed
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"arrival_rate must be > 0 and the trace's rate finite, got {arrival_rate!r}")
        prompts, outputs = self._fitted(t.prompt_lens[:n], t.output_lens[:n], t.lines[:n],
                                        max_model_len or self.max_model_len)
        rng = np.random.default_rng(seed)
        return [RequestSpec(rng.integers(0, vocab_size, size=int(p)).tolist(), int(g), float(a) / scale)
                for p, g, a in zip(prompts, outputs, t.arrivals[:n])]

    def _fitted(self, prompts, outputs, lines, limit):
        """Refuse (or, with ``clip``, shorten) requests whose prompt + output exceeds ``limit``."""
        if limit is None:
            return prompts, outputs
        over = np.flatnonzero(prompts + outputs > limit)
        if len(over) and not self.clip:
            k = over[0]
            raise ValueError(f"trace {self.trace.name}: {len(over)} of {len(prompts)} requests need more than "
                             f"max_model_len ({limit}) tokens, the first at CSV line {lines[k]} ({prompts[k]} "
                             f"prompt + {outputs[k]} output); raise max_model_len (up to the model's context), "
                             "choose a window without them, or clip them (--trace-clip)")
        outputs = np.minimum(outputs, limit - 1)
        return np.minimum(prompts, limit - outputs), outputs


def trace_workload(name_or_path: str | Path, start: float = 0.0, duration: float | None = None,
                   time_scale: float = 1.0, clip: bool = False, max_model_len: int | None = None) -> TraceWorkload:
    """Load a trace (:func:`load_trace`), keep the window ``[start, start +
    duration)`` re-based to 0 s, and replay it ``time_scale`` times faster."""
    return TraceWorkload(load_trace(name_or_path).window(start, duration), time_scale, clip, max_model_len)


def with_limit(workload: TraceWorkload, max_model_len: int | None) -> TraceWorkload:
    """The same replay, refusing or clipping against ``max_model_len``."""
    return replace(workload, max_model_len=max_model_len)
