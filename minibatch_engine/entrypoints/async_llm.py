"""``AsyncLLM``: the online front door. Requests come and go while the engine
runs; each caller streams its own tokens as they are produced.

Shaped like vLLM's ``AsyncLLM.generate``::

    llm = AsyncLLM("tiny")
    async for out in llm.stream("Hello", SamplingParams(max_tokens=16), request_id="r1"):
        print(out.token_id, out.text, out.finish_reason)

How it works. One background asyncio task, the *engine loop*, owns the
:class:`~minibatch_engine.core.engine.Engine`. It repeats: take in the requests and
aborts that arrived since the last step, run one ``Engine.step``, then hand
every stream the tokens its request gained. ``Engine.step`` is blocking (a
model forward takes milliseconds to seconds), so the loop runs it in a
one-thread executor: while the model computes, the event loop stays free to
accept new requests, deliver tokens and notice cancelled consumers (PyTorch
releases the GIL inside its kernels). The engine itself is only touched
between steps, by the loop task, which is why it needs no lock: ``stream`` and
``abort`` only leave a note in an inbox. (vLLM goes one step further and runs
its EngineCore in another *process*, talking over ZeroMQ, so that detokenising
and HTTP never steal the GIL from the scheduler.)

Stop strings (``SamplingParams.stop``) are checked here, on the text handed
out, as vLLM checks them in its front end: a stream that produces one ends with
``finish_reason="stop"`` and its request is aborted in the engine. After every
step the loop reports to its ``stat_loggers`` (:mod:`minibatch_engine.core.engine_stats`):
the server's Prometheus metrics are one.

Cancelling a consumer (``task.cancel()``, or leaving the ``async for`` and
closing the generator) aborts its request: the loop calls ``Engine.abort``
before the next step, which returns the request's KV blocks at once, whether
it was waiting, part-way through a chunked prefill, or decoding.

:func:`open_loop` is the real-time client of ``vllm bench serve``: it sends
requests at given arrival times on the wall clock without waiting for earlier
replies, and records, as a user would, when each token came back. Queueing
time is then part of TTFT.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

from ..config import EngineConfig
from ..core.engine import Engine
from ..core.engine_stats import FinishedRequestStats, IterationStats, SchedulerStats
from ..core.inputs import as_token_ids, check_arrival_time, encode_text
from ..harness.metrics import RequestTiming
from ..core.request import FinishReason, Request
from ..sampling.params import SamplingParams
from ..sampling.logits_process import with_bad_words
from ..core.stop_strings import cut_at, holdback, min_tokens_text
from ..core.trace import Trace


@dataclass
class StreamOutput:
    """One new token of a streamed request (vLLM's delta output).

    ``token_id`` is None only on the last output of a request that ended without
    a new token: ended from outside (``finish_reason == "abort"``), or failed in
    its own step (``"error"``, e.g. its sampling; the other streams go on). ``text`` is the text this token adds (None
    without a tokenizer; empty while a multi-byte character is incomplete).
    ``finish_reason`` is set on the last output only; ``error`` says why when
    it is ``"error"`` (None otherwise)."""
    request_id: str
    token_id: int | None
    text: str | None
    index: int                      # how many output tokens the request has, this one included
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple | None = None   # this token's entry (SamplingParams.logprobs; minibatch_engine.sampling.logprobs)
    prompt_logprobs: list | None = None   # on the first output: the prompt's entries (prompt_logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _error(req: Request, reason: str | None) -> str | None:
    """Why a request failed in its own step (``finish_reason="error"``)."""
    if reason != str(FinishReason.ERROR):
        return None
    return req.error or "the request failed in the engine (no message was recorded)"


@dataclass
class _Stream:
    request_id: str
    queue: asyncio.Queue
    request: Request | None = None
    sent: int = 0                   # output tokens handed to the consumer so far
    text: str = ""                  # text handed out so far
    stop: tuple = ()                # stop strings
    submitted: float = 0.0          # engine wall clock at submission
    last_token: float | None = None # engine wall clock of the last token handed out
    queued: float | None = None     # submission -> first scheduled step, seconds
    num_prompt_tokens: int = 0


class AsyncLLM:
    """An engine that serves concurrent streaming requests (see the module doc).

    ``model``, ``tokenizer``, ``device``, ``dtype``, ``seed`` and the engine
    options are :class:`~minibatch_engine.llm.LLM`'s. ``step_in_thread=False``
    runs each step on the event loop itself (yielding between steps): simpler,
    but the loop cannot deliver tokens or take requests during a step.

    ``history``: ``None`` (the default) keeps every request and every step in
    ``self.engine`` for analysis afterwards, as the book's chapters do. A server
    that runs for days sets a number: the engine's trace then keeps about the
    last ``history`` steps, and each request is forgotten (by the scheduler and
    its policy) once its stream has ended, so memory stays bounded however many
    requests pass through; the per-request metrics, which need the whole trace,
    then refuse it.

    ``stat_loggers``: objects with ``record(SchedulerStats, IterationStats)``
    (:mod:`minibatch_engine.core.engine_stats`), called after every step.
    ``kv_event_publisher``: an object with ``publish(events)``, given each step's
    KV-cache events (:mod:`minibatch_engine.kv.events`; the server's ZeroMQ
    publisher); None (the default) records none.
    ``kv_connector``: prefill/decode disaggregation
    (:class:`~minibatch_engine.cluster.kv_transfer.PDConnector`): it is attached
    to the engine, and told, between steps, of each request that comes with a
    ``kv_transfer`` (:meth:`stream`) and of its end."""

    def __init__(self, model="tiny", tokenizer=None, device: str = "auto", dtype: str = "float32",
                 seed: int = 0, step_in_thread: bool = True, history: int | None = None,
                 stat_loggers: Sequence = (), quantization: str | None = None, kv_event_publisher=None,
                 kv_connector=None, **engine_options):
        from ..model.registry import resolve_model, tokenizer_for
        config = EngineConfig().with_overrides(**engine_options)
        self.model = resolve_model(model, device=device, dtype=dtype, seed=seed, quantization=quantization)
        self.tokenizer = tokenizer if tokenizer is not None else tokenizer_for(getattr(self.model, "source", None))
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        self.engine = Engine(self.model, config, eos_token_id=eos, tokenizer=self.tokenizer)
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.attach(self.engine)
        self.kv_event_publisher = kv_event_publisher
        if kv_event_publisher is not None:
            self.engine.kv_cache.record_kv_events()
        self.history = history
        if history is not None:
            self.engine.trace = Trace(max_steps=history)   # checks the value
        self.step_in_thread = step_in_thread
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._streams: dict[str, _Stream] = {}
        # notes for the loop, keyed by the stream object (an id may be reused once forgotten)
        self._inbox: list[tuple[_Stream, list[int], SamplingParams, str | None, int, dict | None]] = []
        self._aborts: list[_Stream] = []
        self._calls: list[tuple[Callable, asyncio.Future]] = []    # between_steps calls waiting for a step's end
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.stat_loggers = list(stat_loggers)
        self._iteration = IterationStats()
        self._last_logged_step = None
        self._prefix_seen = (0, 0)             # the scheduler's prefix-cache counters at the last report

    # --- the public door -------------------------------------------------------
    async def stream(self, prompt, sampling_params: SamplingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     kv_transfer: dict | None = None) -> AsyncIterator[StreamOutput]:
        """Submit a request and yield each new token as the engine produces it.
        The request is submitted when iteration starts; leaving early or
        cancelling the consumer aborts it. ``priority`` (an integer from
        -2**31 to 2**31 - 1, lower runs first) matters for ``policy="priority"``. ``kv_transfer``: handed to the
        ``kv_connector`` before the request enters the engine (P/D
        disaggregation). Every stream of one ``AsyncLLM`` must come from the
        same event loop while its engine loop runs."""
        if self._closed:
            raise RuntimeError("this AsyncLLM has been shut down: create a new one")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"stream() serves one sequence per request, got n={params.n}; "
                             "use LLM.generate for parallel sampling")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need text: this model has no tokenizer (use stop_token_ids)")
        ids, text = self._encode(prompt)
        params = with_bad_words(params, self.tokenizer, "sampling_params")
        rid = str(request_id) if request_id is not None else f"stream-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already streaming")
        if kv_transfer is not None and self.kv_connector is None:
            raise ValueError("kv_transfer needs an AsyncLLM built with a kv_connector")
        self._start_loop()
        st = self._streams[rid] = _Stream(rid, asyncio.Queue(), stop=params.stop,
                                          submitted=self.engine.wall_now(), num_prompt_tokens=len(ids))
        self._inbox.append((st, ids, params, text, priority, kv_transfer))
        self._wake.set()
        done = False
        try:
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if self._streams.get(rid) is st:
                del self._streams[rid]
            if not done:                        # cancelled, or the consumer left early
                self._abort_soon(st)

    generate = stream       # vLLM's name for the same async generator

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet computing: in the inbox, or waiting in
        the scheduler (preempted ones included). A server refuses new work past a bound."""
        sched = self.engine.scheduler
        return len(self._inbox) + len(getattr(sched, "waiting", ())) + len(getattr(sched, "swapped", ()))

    def scheduler_stats(self) -> SchedulerStats:
        """The gauges now (:class:`~minibatch_engine.core.engine_stats.SchedulerStats`)."""
        sched, kv = self.engine.scheduler, self.engine.kv_cache
        running = len(getattr(sched, "running", ())) if hasattr(sched, "running") else \
            sum(not r.is_finished and r.first_scheduled_step is not None for r in sched.requests.values())
        return SchedulerStats(running, self.num_waiting, kv.num_used_blocks / max(1, kv.num_blocks))

    async def abort(self, request_id: str) -> None:
        """End a request from outside; its stream yields a last output with
        ``finish_reason="abort"`` and its KV memory is freed before the next step."""
        self._check_loop()
        st = self._streams.get(str(request_id))
        if st is not None:
            self._abort_soon(st)

    def abort_all(self) -> int:
        """Abort every stream still running (each ends with ``finish_reason="abort"``);
        returns how many. A server shutting down calls it once its drain time is up."""
        streams = list(self._streams.values())
        for st in streams:
            self._abort_soon(st)
        return len(streams)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's ``reset_prefix_cache``), between
        two steps; with a KV-event publisher, subscribers get ``AllBlocksCleared``.
        False, changing nothing, while a request holds blocks or without a prefix cache."""
        if getattr(self.engine.kv_cache, "reset_prefix_cache", None) is None:
            return False
        return await self.between_steps(lambda engine: self._reset_now())

    async def between_steps(self, fn: Callable):
        """``fn(engine)``, run on the engine loop between two steps (when nothing
        else touches the engine), and its result (or its exception)."""
        self._check_loop()
        if self._task is None or self._task.done():     # no engine loop: nothing is stepping
            return fn(self.engine)
        done = asyncio.get_running_loop().create_future()
        self._calls.append((fn, done))
        self._wake.set()
        return await done

    def _reset_now(self) -> bool:
        ok = self.engine.kv_cache.reset_prefix_cache()
        if self.kv_event_publisher is not None:
            self._publish_kv_events()
        return ok

    async def wait_idle(self) -> None:
        """Return once every submitted request and abort has been dealt with."""
        while self._inbox or self._aborts or self.engine.has_unfinished():
            if self._error is not None:
                raise self._error
            await asyncio.sleep(0.001)

    async def shutdown(self) -> None:
        """Stop the engine loop (unfinished streams are aborted) and release its
        thread. It returns normally after an engine failure too; a second call
        does nothing, and ``stream`` refuses new requests afterwards. Call it
        from the event loop the streams use."""
        if self._closed:
            return
        self._check_loop()
        self._closed = True
        for st in list(self._streams.values()):
            self._abort_soon(st)
        task, self._task = self._task, None
        try:
            if task is not None and not task.done():
                if self._error is None:
                    try:
                        await self.wait_idle()
                    except Exception:           # the engine failed meanwhile: the streams were told
                        pass
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        finally:
            self._executor.shutdown(wait=True)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.shutdown()

    # --- inside --------------------------------------------------------------------
    def _encode(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("the prompt is text but this model has no tokenizer: pass token ids")
            return encode_text(self.tokenizer, prompt, "prompt"), prompt
        return as_token_ids(prompt, "prompt"), None

    def _abort_soon(self, st: _Stream) -> None:
        self._aborts.append(st)
        if self._wake is not None:
            self._wake.set()

    def _start_loop(self) -> None:
        """Start the engine loop on the running event loop (again, after a
        previous loop has gone, e.g. a second ``asyncio.run``)."""
        if self._error is not None:
            raise RuntimeError("the engine loop has failed") from self._error
        loop = asyncio.get_running_loop()
        self._check_loop()
        if self._task is not None and not self._task.done():
            return
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="AsyncLLM engine loop")

    def _check_loop(self) -> None:
        """Refuse a call from an event loop other than the one the engine loop runs on."""
        if self._task is not None and not self._task.done() and \
                self._task.get_loop() is not asyncio.get_running_loop():
            raise RuntimeError("this AsyncLLM's engine loop is running on another event loop (another "
                               "thread, or an asyncio.run still going): call it from that loop, or create "
                               "one AsyncLLM per event loop")

    def _take_inbox(self) -> None:
        """Apply the aborts and new requests that came in since the last step."""
        aborts, self._aborts = self._aborts, []
        for st in aborts:
            if any(x[0] is st for x in self._inbox):    # never submitted: it ends here
                self._inbox = [x for x in self._inbox if x[0] is not st]
                text = "" if self.tokenizer is not None else None
                st.queue.put_nowait(StreamOutput(st.request_id, None, text, 0, str(FinishReason.ABORT)))
                continue
            req = st.request
            if req is None or not self._holds(req):
                continue                        # already finished and delivered (or refused)
            self.engine.abort(req.request_id)   # frees its KV blocks now
            if self._streams.get(st.request_id) is not st:
                st.request = None               # its consumer is gone: nothing to deliver
                self._iteration.finished_requests.append(FinishedRequestStats(
                    str(FinishReason.ABORT), st.num_prompt_tokens, st.sent,
                    self.engine.wall_now() - st.submitted, st.queued))
                self._forget(req)
        inbox, self._inbox = self._inbox, []
        for st, ids, params, text, priority, transfer in inbox:
            rid = st.request_id
            try:
                if transfer is not None:
                    self.kv_connector.on_add(self.engine, rid, transfer)
                st.request = self.engine.add_request(ids, params, request_id=rid, prompt_text=text,
                                                     priority=priority)
            except (ValueError, TypeError) as e:
                if transfer is not None:
                    self.kv_connector.on_end(self.engine, rid)
                st.queue.put_nowait(e)

    def _dispatch(self) -> None:
        """Hand every stream the tokens its request gained in the last step."""
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        now, it = self.engine.wall_now(), self._iteration
        for st in list(self._streams.values()):
            req = st.request
            if req is None:
                continue
            if st.queued is None and req.first_scheduled_step is not None and len(self.engine.trace):
                st.queued = max(0.0, self.engine.trace[-1].wall_start - st.submitted)
            new, reason = req.output_token_ids[st.sent:], None
            for i, tok in enumerate(new):
                st.sent += 1
                if st.last_token is None:
                    it.time_to_first_tokens.append(now - st.submitted)
                    it.num_prompt_tokens += st.num_prompt_tokens
                else:
                    it.inter_token_latencies.append(now - st.last_token)
                st.last_token = now
                it.num_generation_tokens += 1
                last = req.is_finished and i == len(new) - 1
                text, stopped = self._text_delta(st, decode, last)
                reason = "stop" if stopped else str(req.finish_reason) if last else None
                st.queue.put_nowait(StreamOutput(
                    req.request_id, tok, text, st.sent, reason, _error(req, reason),
                    None if req.logprobs is None else req.logprobs[st.sent - 1],
                    req.prompt_logprobs if st.sent == 1 else None))
                if stopped:                     # a stop string: the engine need not go on
                    if not req.is_finished:
                        self.engine.abort(req.request_id)
                    break
            if reason is None and req.is_finished:     # ended without a new token: aborted
                reason = str(req.finish_reason or FinishReason.ABORT)
                st.queue.put_nowait(StreamOutput(req.request_id, None, "" if decode else None, st.sent, reason,
                                                 _error(req, reason)))
            if reason is not None:
                it.finished_requests.append(FinishedRequestStats(
                    reason, st.num_prompt_tokens, st.sent, now - st.submitted, st.queued))
                st.request = None                # nothing more will come
                self._forget(req)

    def _log_stats(self) -> None:
        """Report the step to every stat logger."""
        if not self.stat_loggers:
            self._iteration = IterationStats()
            return
        it, self._iteration = self._iteration, IterationStats()
        trace = self.engine.trace
        if len(trace) and trace[-1].step != self._last_logged_step:    # (an empty step records nothing)
            self._last_logged_step = trace[-1].step
            it.num_preemptions = len(trace[-1].preempted)
        sched = self.engine.scheduler              # the prefix-cache counters' growth since the last report
        totals = (getattr(sched, "prefix_cache_queries", 0), getattr(sched, "prefix_cache_hits", 0))
        seen = self._prefix_seen
        it.prefix_cache_queries, it.prefix_cache_hits = totals[0] - seen[0], totals[1] - seen[1]
        self._prefix_seen = totals
        stats = self.scheduler_stats()
        for logger in self.stat_loggers:
            logger.record(stats, it)

    def _holds(self, req: Request) -> bool:
        """``req`` is the engine's request under its id (not one forgotten since)."""
        return self.engine.scheduler.requests.get(req.request_id) is req

    def _forget(self, req: Request) -> None:
        """A request has ended and nobody will read it again: the connector drops
        what it kept for it; with bounded history, the engine lets go of it."""
        if self.kv_connector is not None:
            self.kv_connector.on_end(self.engine, req.request_id)
        if self.history is not None and self._holds(req):
            self.engine.forget(req.request_id)

    @staticmethod
    def _text_delta(st: _Stream, decode, last: bool) -> tuple[str | None, bool]:
        """Incremental detokenisation: decode everything, hand out what is new,
        holding back a trailing incomplete character (U+FFFD) until it completes,
        and, with stop strings, the last characters that may start one. Returns
        (the new text, whether a stop string ended it)."""
        if decode is None:
            return None, False
        full = decode(st.request.output_token_ids[:st.sent])
        if full.endswith("\ufffd") and not last:
            return "", False
        params = st.request.sampling_params
        cut = cut_at(full, params, min_tokens_text(st.request.output_token_ids, decode, params)) \
            if st.stop else None
        if cut is not None:
            full = full[:max(cut, len(st.text))]
        elif not last and st.stop:
            full = full[:max(len(st.text), len(full) - holdback(st.stop))]
        delta, st.text = full[len(st.text):], full
        return delta, cut is not None

    def _publish_kv_events(self) -> None:
        events = self.engine.kv_cache.take_kv_events()
        if events:
            self.kv_event_publisher.publish(events)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while self._calls:              # between steps: the engine is the loop's alone
                    fn, done = self._calls.pop(0)
                    if done.done():
                        continue
                    try:
                        done.set_result(fn(self.engine))
                    except Exception as e:      # noqa: BLE001  (handed to the caller)
                        done.set_exception(e)
                self._take_inbox()
                self._dispatch()                # requests aborted or refused above end here
                if self._iteration.finished_requests:
                    self._log_stats()
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    if not (self._inbox or self._aborts or self._calls):
                        await self._wake.wait()
                    continue
                if self.step_in_thread:
                    await loop.run_in_executor(self._executor, self.engine.step)
                else:
                    self.engine.step()
                    await asyncio.sleep(0)
                if self.kv_event_publisher is not None:
                    self._publish_kv_events()
                self._dispatch()
                self._log_stats()
        except asyncio.CancelledError:
            raise
        except Exception as e:                  # the engine failed: every stream learns it
            self._error = e                     # (kept, not raised: later calls report it)
            for st in self._streams.values():
                st.queue.put_nowait(e)


@dataclass
class ClientRecord:
    """What the open-loop client saw of one request (wall seconds since its start)."""
    request_id: str
    timing: RequestTiming
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


async def open_loop(llm: AsyncLLM, requests: Sequence, arrival_times: Sequence[float] | None = None,
                    progress: Callable[[int], None] | None = None) -> list[ClientRecord]:
    """Send ``requests`` at their arrival times on the wall clock, each without
    waiting for the others (an open loop, like ``vllm bench serve``), and record
    when each token arrives. ``requests`` are :class:`~minibatch_engine.harness.workload.RequestSpec`
    (their ``arrival_time`` is used) or ``(prompt, SamplingParams)`` pairs with
    ``arrival_times`` given. Returns one :class:`ClientRecord` per request, in order."""
    t0 = time.perf_counter()

    async def one(i: int, prompt, params, at: float) -> ClientRecord:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        sent = time.perf_counter() - t0
        times, toks, reason = [], [], None
        async for out in llm.stream(prompt, params, request_id=f"client-{i}"):
            if out.token_id is not None:
                times.append(time.perf_counter() - t0)
                toks.append(out.token_id)
            reason = out.finish_reason
        if progress is not None:
            progress(1)
        return ClientRecord(f"client-{i}", RequestTiming(sent, times, len(prompt)), toks, reason)

    jobs = []
    for i, r in enumerate(requests):
        if hasattr(r, "prompt_token_ids"):
            prompt, params, at = r.prompt_token_ids, r.sampling_params(), r.arrival_time
        else:
            (prompt, params), at = r, arrival_times[i]
        at = check_arrival_time(at, f"requests[{i}]: arrival time")   # a wall clock waits for it
        jobs.append(one(i, prompt, params, at))
    return list(await asyncio.gather(*jobs))
