"""``/metrics``: the engine's state in Prometheus's text format, with vLLM's
metric names under the ``minibatch:`` prefix (``vllm:num_requests_running``
here is ``minibatch:num_requests_running``), each labelled ``model_name``.
``prefixes=("vllm",)`` (``serve --metrics-prefix vllm``) names them as vLLM
does, so vLLM's Grafana dashboard, autoscalers and gateways that read
``vllm:num_requests_waiting`` or ``vllm:kv_cache_usage_perc`` work unchanged;
several prefixes serve every series under each. The default stays
``minibatch:``: a series named ``vllm:`` claims to come from vLLM, which a
dashboard mixing both engines would believe.

* gauges, the state now: ``num_requests_running``, ``num_requests_waiting``
  (submitted, not yet computing: queued or preempted), ``kv_cache_usage_perc``
  (the share of KV blocks held, 0 to 1, as vLLM's despite the name);
* counters, totals since start (Prometheus adds ``_total``):
  ``num_preemptions``, ``prompt_tokens``, ``generation_tokens``,
  ``request_success`` (by ``finished_reason``), and the prefix cache's
  ``prefix_cache_queries`` and ``prefix_cache_hits``, in tokens as vLLM's:
  each admission of a request looks up all its tokens (a query) and finds
  some already cached (the hits), so ``hits / queries`` is the share of
  prompt tokens not recomputed (a preempted request's return counts again);
* ``cache_config_info``: vLLM's info metric, value 1, whose labels are the
  KV cache's configuration: ``block_size``, ``cache_dtype`` (``kv_cache_dtype``),
  ``num_gpu_blocks`` (the pool's blocks, on whatever device), ``kv_bytes_per_token``
  and ``kv_layout``; a quantized cache shows its larger block count here;
* ``kv_cache_capacity_bytes`` and ``kv_cache_blocks``, labelled ``kv_cache``
  (``target``, and ``draft`` for speculative decoding's draft model), beside
  ``kv_budget_bytes``: the split of one KV memory budget between the two
  caches (this engine's own, set once at start; vLLM has none);
* histograms, one observation per request or per token (seconds, vLLM's
  buckets): ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds``; and per
  finished request, in tokens (vLLM's 1-2-5 buckets up to the context
  length): ``request_prompt_tokens``, ``request_generation_tokens``.

Read them with PromQL: a rate is ``rate(minibatch:generation_tokens_total[1m])``
(tokens/s), a percentile ``histogram_quantile(0.99,
rate(minibatch:time_to_first_token_seconds_bucket[5m]))``.
"""
from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (the response's content type)

from ...core.engine_stats import IterationStats, SchedulerStats

PREFIX = "minibatch:"           # the default prefix
disable_created_metrics()       # no "_created" series beside each counter (one process-wide switch)
# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


def token_buckets(max_value: int) -> list[int]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _Fan:
    """One metric under several names: ``labels``, ``inc``, ``set`` and
    ``observe`` reach each."""

    def __init__(self, parts):
        self.parts = parts

    def labels(self, *values):
        return _Fan([p.labels(*values) for p in self.parts])

    def inc(self, amount=1):
        for p in self.parts:
            p.inc(amount)

    def set(self, value):
        for p in self.parts:
            p.set(value)

    def observe(self, value):
        for p in self.parts:
            p.observe(value)


def check_prefixes(prefixes) -> tuple[str, ...]:
    """Metric-name prefixes as given (``"vllm"`` or ``"vllm:"``), checked:
    Prometheus names are letters, digits, ``_`` and ``:``, not starting with a digit."""
    out = []
    for p in ([prefixes] if isinstance(prefixes, str) else list(prefixes)):
        name = p.rstrip(":")
        if not name or not re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", name):
            raise ValueError(f"--metrics-prefix {p!r} is not a Prometheus name: use letters, digits, "
                             "'_' and ':' (e.g. vllm)")
        if name + ":" not in out:
            out.append(name + ":")
    if not out:
        raise ValueError("--metrics-prefix needs at least one prefix (e.g. minibatch or vllm)")
    return tuple(out)


class PrometheusStatLogger:
    """A stat logger for :class:`~minibatch_engine.entrypoints.async_llm.AsyncLLM` that
    keeps the metrics above in its own registry (one per server), under each
    of ``prefixes`` (default ``minibatch:``). ``max_model_len`` bounds the
    token histograms' buckets."""

    def __init__(self, model_name: str, prefixes=("minibatch",), max_model_len: int = 2048):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.prefixes = check_prefixes(prefixes)
        lab = ["model_name"]

        def make(cls, name, doc, **kw):
            extra = kw.pop("extra", [])
            fan = _Fan([cls(p + name, doc, lab + extra, registry=self.registry, **kw) for p in self.prefixes])
            if not extra:                # shown (at 0) from the start, as vLLM's are
                fan.labels(model_name)
            return fan
        self.running = make(Gauge, "num_requests_running", "Requests being computed.")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting to be computed (queued or preempted).")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "KV-cache usage: 1 means every block is held.")
        self.preemptions = make(Counter, "num_preemptions", "Preemptions since start.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of requests that got a first token.")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated.")
        self.success = make(Counter, "request_success", "Requests ended, by finish reason.",
                            extra=["finished_reason"])
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Time between consecutive tokens.",
                        buckets=ITL_BUCKETS)
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "Submission to last token.",
                        buckets=REQUEST_BUCKETS)
        self.queue = make(Histogram, "request_queue_time_seconds", "Submission to first scheduled step.",
                          buckets=REQUEST_BUCKETS)
        self.prefix_queries = make(Counter, "prefix_cache_queries",
                                   "Prefix-cache queries, in tokens looked up (one lookup per admission).")
        self.prefix_hits = make(Counter, "prefix_cache_hits", "Prefix-cache hits, in tokens found cached.")
        tokens = token_buckets(max_model_len)
        self.prompt_hist = make(Histogram, "request_prompt_tokens", "Prompt tokens of each finished request.",
                                buckets=tokens)
        self.generation_hist = make(Histogram, "request_generation_tokens",
                                    "Generated tokens of each finished request.", buckets=tokens)

    def set_cache_config(self, engine) -> None:
        """``cache_config_info`` from the engine's KV cache, and the split of the
        KV budget between the target's cache and a draft model's (set once, at start)."""
        kv, cfg = engine.kv_cache, engine.config
        split, m = engine.kv_split(), self.model_name
        for prefix in self.prefixes:
            Gauge(prefix + "kv_budget_bytes", "KV memory budget shared by the target's and the draft's caches.",
                  ["model_name"], registry=self.registry).labels(m).set(split["kv_budget_bytes"])
            size = Gauge(prefix + "kv_cache_capacity_bytes", "Bytes of each KV cache (target, draft).",
                         ["model_name", "kv_cache"], registry=self.registry)
            blocks = Gauge(prefix + "kv_cache_blocks", "Blocks (or reserved rows) of each KV cache (target, draft).",
                           ["model_name", "kv_cache"], registry=self.registry)
            for owner in ("target", "draft"):
                size.labels(m, owner).set(split[f"{owner}_kv_bytes"])
                blocks.labels(m, owner).set(split[f"{owner}_kv_blocks"])
        labels = {"block_size": kv.block_size, "cache_dtype": cfg.kv_cache_dtype, "num_gpu_blocks": kv.num_blocks,
                  "kv_bytes_per_token": kv.bytes_per_token, "kv_layout": cfg.kv_layout}
        for prefix in self.prefixes:
            info = Gauge(prefix + "cache_config_info", "The KV cache's configuration (labels); value 1.",
                         ["model_name", *labels], registry=self.registry)
            info.labels(self.model_name, *map(str, labels.values())).set(1)

    def set_gauges(self, s: SchedulerStats) -> None:
        m = self.model_name
        self.running.labels(m).set(s.num_running_reqs)
        self.waiting.labels(m).set(s.num_waiting_reqs)
        self.kv_usage.labels(m).set(s.kv_cache_usage)

    def record(self, scheduler_stats: SchedulerStats, it: IterationStats) -> None:
        """Called by the engine loop after every step."""
        m = self.model_name
        self.set_gauges(scheduler_stats)
        self.preemptions.labels(m).inc(it.num_preemptions)
        self.prompt_tokens.labels(m).inc(it.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(it.num_generation_tokens)
        self.prefix_queries.labels(m).inc(it.prefix_cache_queries)
        self.prefix_hits.labels(m).inc(it.prefix_cache_hits)
        for x in it.time_to_first_tokens:
            self.ttft.labels(m).observe(x)
        for x in it.inter_token_latencies:
            self.itl.labels(m).observe(x)
        for f in it.finished_requests:
            self.success.labels(m, f.finish_reason).inc()
            self.e2e.labels(m).observe(f.e2e_latency)
            self.prompt_hist.labels(m).observe(f.num_prompt_tokens)
            self.generation_hist.labels(m).observe(f.num_generation_tokens)
            if f.queued_time is not None:
                self.queue.labels(m).observe(f.queued_time)

    def exposition(self) -> bytes:
        """The text ``/metrics`` returns."""
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{'name{a="x",b="y"}': value}``, labels sorted by
    name (a reader for tests and clients; label values without commas)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            if "{" in key:
                name, labels = key[:-1].split("{", 1)
                key = name + "{" + ",".join(sorted(labels.split(","))) + "}"
            out[key] = float(value)
    return out
