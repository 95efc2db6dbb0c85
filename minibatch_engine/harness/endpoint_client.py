"""The open-loop client of chapter 8, against any OpenAI-compatible server
(``minibatch-engine serve``, vLLM, SGLang): ``bench --endpoint URL`` and
``sweep --endpoint URL``.

The same seeded workloads and arrival processes as the in-process runs
(:func:`~minibatch_engine.harness.workload.make_workload`); each request is sent at its
arrival time on the wall clock, whether or not earlier ones have returned, as
``POST /v1/completions`` with the prompt as token ids, ``max_tokens`` from the
workload, ``ignore_eos`` (so output lengths follow the workload, as
``vllm bench serve`` sets it), greedy, streamed with
``stream_options.include_usage``. A token's time is the arrival of the
server-sent event that carries it; a chunk that carries several tokens (the
server's usage count says how many) counts them all at its arrival. The
latency and throughput keys are then :func:`~minibatch_engine.harness.metrics.serving_metrics`'s,
exactly as the in-process runs compute them, with ``clock`` ``"wall"``.

Where the server exposes Prometheus metrics with vLLM's names (``vllm:`` or
this engine's ``minibatch:``), the summary adds what they counted during the
run: preemptions, prompt and generation tokens.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from tqdm.auto import tqdm

from .metrics import DEFAULT_PERCENTILES, RequestTiming, parse_goodput, parse_percentiles, serving_metrics
from .workload import make_workload

SERVER_COUNTERS = ("num_preemptions_total", "prompt_tokens_total", "generation_tokens_total")


@dataclass
class EndpointRecord:
    """What the client saw of one request."""
    timing: RequestTiming
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None


def _aiohttp():
    try:
        import aiohttp
    except ImportError:
        raise ValueError("--endpoint needs aiohttp: pip install 'minibatch-engine[serve]'") from None
    return aiohttp


def base_url(url: str, what: str = "--endpoint") -> str:
    """A server's base URL (no trailing ``/`` nor ``/v1``), or ValueError naming
    ``what`` when it is not ``http(s)://HOST[:PORT][/PATH]``."""
    from urllib.parse import urlsplit
    def bad(detail: str = "") -> ValueError:
        return ValueError(f"{what} {url!r} is a malformed URL{detail}: expected http://HOST[:PORT] "
                          "(e.g. http://127.0.0.1:8000)")
    if not isinstance(url, str):
        raise bad()
    try:
        parts = urlsplit(url)
        parts.port                              # noqa: B018  (a port out of range raises here)
    except ValueError as e:
        raise bad(f" ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise bad()
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


_base = base_url


async def served_model(session, url: str, wanted: str | None) -> str:
    """The model to ask for: ``wanted`` if the server serves it, else (when
    ``wanted`` is None or the local default ``"tiny"``) the first one it lists."""
    async with session.get(f"{url}/v1/models") as r:
        if r.status != 200:
            raise ValueError(f"{url}/v1/models answered HTTP {r.status}: is it an OpenAI-compatible server?")
        names = [m["id"] for m in (await r.json())["data"]]
    if wanted in names:
        return wanted
    if wanted in (None, "tiny") and names:
        return names[0]
    raise ValueError(f"the server at {url} serves {names}, not {wanted!r}: pass --model NAME")


async def scrape(session, url: str) -> dict[str, float]:
    """The server's counters (:data:`SERVER_COUNTERS`, summed over labels), or {}."""
    try:
        async with session.get(f"{url}/metrics") as r:
            text = await r.text() if r.status == 200 else ""
    except Exception:                       # noqa: BLE001  (no metrics: nothing to add)
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0].split(":", 1)[-1]
        if name in SERVER_COUNTERS:
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def _one(session, url: str, model: str, spec, t0: float, api_key: str, render=None,
               headers=None) -> EndpointRecord:
    await asyncio.sleep(max(0.0, spec.arrival_time - (time.perf_counter() - t0)))
    sent = time.perf_counter() - t0
    body = {"model": model, "prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if spec.priority:
        body["priority"] = spec.priority
    if render is not None:
        body.update(render(spec))
    sent_headers = {"Authorization": f"Bearer {api_key}", **(headers(spec) if headers is not None else {})}
    times, reason, used, error = [], None, None, None
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=sent_headers) as r:
            if r.status != 200:
                error = f"HTTP {r.status}: {(await r.text())[:200]}"
            else:
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        error = str(obj["error"].get("message", obj["error"]))
                    for c in obj.get("choices") or []:
                        times.append(time.perf_counter() - t0)
                        reason = c.get("finish_reason") or reason
                    if obj.get("usage"):
                        used = obj["usage"].get("completion_tokens")
    except Exception as e:                  # noqa: BLE001  (a failed request is reported, not fatal)
        error = f"{type(e).__name__}: {e}"
    if used is not None and times and used > len(times):
        times += [times[-1]] * (used - len(times))
    return EndpointRecord(RequestTiming(sent, times, len(spec.prompt_token_ids)), reason,
                          used if used is not None else len(times), error)


async def open_loop_endpoint(url: str, specs: Sequence, model: str | None = None, api_key: str = "EMPTY",
                             progress: Callable[[int], None] | None = None,
                             render: Callable[[object], dict] | None = None,
                             headers: Callable[[object], dict] | None = None,
                             ) -> tuple[list[EndpointRecord], str, dict, dict]:
    """Send ``specs`` (:class:`~minibatch_engine.harness.workload.RequestSpec`) at their
    arrival times. Returns (records in order, the model asked for, the server's
    counters before, and after). ``render(spec)``, if given, returns fields that
    replace or join the request body's (a text ``prompt``), and ``headers(spec)``
    HTTP headers to add (a session id), for routers that key on text or on a
    session."""
    aiohttp = _aiohttp()
    url = _base(url)
    limits = aiohttp.TCPConnector(limit=0)          # an open loop: no cap on connections
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=limits, timeout=timeout) as session:
        try:
            name = await served_model(session, url, model)
        except aiohttp.ClientError as e:
            raise ValueError(f"cannot reach {url}: {e}") from None
        before = await scrape(session, url)
        t0 = time.perf_counter()

        async def tracked(spec):
            rec = await _one(session, url, name, spec, t0, api_key, render, headers)
            if progress is not None:
                progress(1)
            return rec
        records = list(await asyncio.gather(*(tracked(s) for s in specs)))
        after = await scrape(session, url)
    return records, name, before, after


def _run(coro):
    """``asyncio.run``, also from inside a running event loop (a notebook's):
    there in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def bench_endpoint(url: str, model: str | None = None, workload: str = "uniform", num_requests: int = 64,
                   seed: int = 0, arrival_rate: float | None = None, burstiness: float = 1.0,
                   percentiles=DEFAULT_PERCENTILES, goodput=None, api_key: str = "EMPTY",
                   progress: bool = True, vocab_size: int = 256) -> dict:
    """One workload against a server; the summary has the in-process run's
    workload keys and vLLM's latency keys, in wall seconds (``clock: "wall"``).
    ``vocab_size``: prompts draw token ids below it (256 suits byte-level
    models and any larger vocabulary)."""
    ps, slo = parse_percentiles(percentiles), parse_goodput(goodput)
    specs = make_workload(workload, num_requests, seed=seed, vocab_size=vocab_size, arrival_rate=arrival_rate,
                          burstiness=burstiness)
    with tqdm(total=len(specs), desc=f"bench {_base(url)}", unit="req", disable=not progress,
              leave=False) as bar:
        records, name, before, after = _run(open_loop_endpoint(url, specs, model, api_key, bar.update))
    return summarize_endpoint(records, specs, url=_base(url), model=name, workload=workload, seed=seed,
                              arrival_rate=arrival_rate, burstiness=burstiness, ps=ps, slo=slo,
                              server=(before, after))


def summarize_endpoint(records, specs, *, url, model, workload, seed, arrival_rate, burstiness, ps, slo,
                       server=({}, {})) -> dict:
    """The summary dict of :func:`bench_endpoint` (keys as ``bench``'s)."""
    done = [r for r in records if r.timing.num_output_tokens and r.error is None]
    out_tokens = sum(r.timing.num_output_tokens for r in done)
    s = {"endpoint": url, "model": model, "workload": str(workload), "num_requests": len(specs),
         "arrival_rate": arrival_rate, "burstiness": burstiness, "seed": seed, "clock": "wall",
         "latency_source": "client", "finished_requests": len(done),
         "failed_requests": sum(r.error is not None for r in records), "output_tokens": out_tokens}
    errors = [r.error for r in records if r.error]
    if errors:
        s["first_error"] = errors[0]
    if done:
        s.update(serving_metrics([r.timing for r in done], ps=ps, goodput=slo))
        s["wall_seconds"] = s["duration_s"]
        s["output_tokens_per_second"] = s["output_throughput"]
    before, after = server
    for k in SERVER_COUNTERS:
        if k in after:
            s[f"server_{k}"] = after[k] - before.get(k, 0.0)
    if "server_num_preemptions_total" in s:
        s["preemptions"] = int(s["server_num_preemptions_total"])
    return s


def sweep_endpoint(url: str, rates: Sequence[float], model: str | None = None, jsonl: str | None = None,
                   progress: bool = True, warmup: float | None = None, **options) -> list[dict]:
    """:func:`bench_endpoint` at every rate, one row each (also appended to
    ``jsonl``), with the steady-state keys of :func:`~minibatch_engine.harness.sweep.steady_metrics`."""
    from .sweep import STEADY_WARMUP, steady_metrics
    rows = []
    out = open(jsonl, "w") if jsonl else None
    try:
        for rate in tqdm(rates, desc="sweep", unit="rate", disable=not progress):
            ps, slo = parse_percentiles(options.get("percentiles", DEFAULT_PERCENTILES)), \
                parse_goodput(options.get("goodput"))
            specs = make_workload(options.get("workload", "uniform"), options.get("num_requests", 64),
                                  seed=options.get("seed", 0), vocab_size=256, arrival_rate=rate,
                                  burstiness=options.get("burstiness", 1.0))
            records, name, before, after = _run(
                open_loop_endpoint(url, specs, model, options.get("api_key", "EMPTY")))
            row = summarize_endpoint(records, specs, url=_base(url), model=name,
                                     workload=options.get("workload", "uniform"), seed=options.get("seed", 0),
                                     arrival_rate=rate, burstiness=options.get("burstiness", 1.0), ps=ps,
                                     slo=slo, server=(before, after))
            row.update(steady_metrics([r.timing for r in records], goodput=slo,
                                      warmup=STEADY_WARMUP if warmup is None else warmup))
            row = {"rate": rate, **row}
            rows.append(row)
            if out is not None:
                out.write(json.dumps(row, default=str) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
    return rows
