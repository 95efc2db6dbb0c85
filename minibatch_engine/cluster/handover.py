"""A real prefill/decode hand-over on the CPU: two engine processes.

The prefill process runs each prompt with ``max_tokens=1`` (its first token),
copies the prompt's K/V out of its pool (:class:`~.connector.KVSavingRunner`)
and sends it, with the prompt and the first token, down a pipe. The decode
process admits the request with that K/V written into the blocks its
scheduler gives it (:class:`~.connector.KVReceivingScheduler`,
:class:`~.connector.KVLoadingRunner`) and decodes the rest. Greedy tokens must
equal a lone full recompute of the prompt (the book's correctness rule), and
when both are done neither process may hold a block, an expectation, or a
tensor waiting to be sent or loaded.

``python -m minibatch_engine.cluster.handover`` runs a small demonstration.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

import torch

from ..sampling.params import SamplingParams

END = None          # sent down a pipe: no more requests


def _engine(cls, model: str, **options):
    from ..model.registry import resolve_model
    return cls(resolve_model(model, device="cpu", dtype="float32"), **options)


def leaks(engine) -> dict:
    """What an idle engine still holds: blocks referenced by a request, and
    the connector's waiting entries (all should be 0)."""
    runner = engine.runner
    return {"blocks_in_use": engine.kv_cache.num_used_blocks,
            "expected": len(getattr(engine.scheduler, "received", {})),
            "outbox": len(getattr(runner, "outbox", {})), "inbox": len(getattr(runner, "inbox", {}))}


def prefill_worker(model: str, inbox, outbox, options: dict) -> None:
    """Process 1: prompts in, (id, prompt, first token, K/V bytes) out."""
    from ..core.engine import Engine
    from .connector import KVSavingRunner
    torch.set_num_threads(1)
    engine = _engine(Engine, model, **options)
    engine.runner = KVSavingRunner(engine.runner)
    while (msg := inbox.recv()) is not END:
        rid, prompt = msg
        t0 = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=rid)
        for req in engine.run():
            kv = engine.runner.take(req.request_id)
            engine.forget(req.request_id)
            outbox.send((req.request_id, list(req.prompt_token_ids), req.output_token_ids[0],
                         kv.numpy(), time.perf_counter() - t0))
    outbox.send(("leaks", leaks(engine)))


def decode_worker(model: str, inbox, results, max_tokens: dict, options: dict) -> None:
    """Process 2: hand-overs in, finished token lists out."""
    from .connector import KVLoadingRunner, KVReceivingEngine
    torch.set_num_threads(1)
    engine = _engine(KVReceivingEngine, model, **options)
    engine.runner = KVLoadingRunner(engine.runner)
    while (msg := inbox.recv())[0] != "leaks":
        rid, prompt, first, kv, _ = msg
        engine.scheduler.expect(rid, len(prompt))
        engine.runner.put(rid, torch.from_numpy(kv))
        if max_tokens[rid] > 1:
            engine.add_request(prompt + [first], SamplingParams(max_tokens=max_tokens[rid] - 1, temperature=0.0),
                               request_id=rid)
            done = engine.run()
            results.send((rid, [first, *done[0].output_token_ids], kv.nbytes))
            engine.forget(rid)
        else:
            engine.scheduler.forget_expected(rid)
            engine.runner.inbox.pop(rid)
            results.send((rid, [first], kv.nbytes))
    results.send(("leaks", {"prefill": msg[1], "decode": leaks(engine)}))


@dataclass
class HandoverResult:
    """Per request: the greedy tokens and the bytes of K/V handed over; and what
    each process still held at the end (:func:`leaks`)."""
    tokens: dict[str, list[int]]
    kv_bytes: dict[str, int]
    leaks: dict[str, dict]


def run_handover(prompts: list[list[int]], max_tokens: int | list[int] = 8, model: str = "tiny",
                 timeout_s: float = 300.0, **engine_options) -> HandoverResult:
    """Hand ``prompts`` (token ids) from a prefill process to a decode process
    (``spawn``-ed, joined by pipes) and return what came out. ``engine_options``
    go to both engines (paged KV, any block size, any attention backend)."""
    if not prompts:
        raise ValueError("give at least one prompt")
    lens = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(lens) != len(prompts) or any(n < 1 for n in lens):
        raise ValueError(f"max_tokens: one integer >= 1, or one per prompt; got {max_tokens!r}")
    ids = [f"req-{i}" for i in range(len(prompts))]
    ctx = mp.get_context("spawn")
    to_prefill, prefill_in = ctx.Pipe()
    kv_out, kv_in = ctx.Pipe()
    results_in, results_out = ctx.Pipe()
    procs = [ctx.Process(target=prefill_worker, args=(model, prefill_in, kv_out, engine_options)),
             ctx.Process(target=decode_worker, args=(model, kv_in, results_out, dict(zip(ids, lens)),
                                                     engine_options))]
    for p in procs:
        p.start()
    try:
        for rid, prompt in zip(ids, prompts):
            to_prefill.send((rid, list(prompt)))
        to_prefill.send(END)
        tokens, nbytes = {}, {}
        while True:
            if not results_in.poll(timeout_s):
                raise TimeoutError(f"no hand-over result within {timeout_s} s")
            msg = results_in.recv()
            if msg[0] == "leaks":
                break
            tokens[msg[0]], nbytes[msg[0]] = msg[1], msg[2]
    finally:
        for p in procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.terminate()
    return HandoverResult(tokens, nbytes, msg[1])


if __name__ == "__main__":
    from ..model.reference import reference_generate
    from ..model.registry import resolve_model
    ps = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [40, 41, 42, 43, 44]]
    out = run_handover(ps, max_tokens=8)
    ref = resolve_model("tiny")
    for (rid, toks), p in zip(out.tokens.items(), ps):
        print(rid, toks, "== reference:", toks == reference_generate(ref, p, 8), f"({out.kv_bytes[rid]} bytes of K/V)")
    print("left held:", out.leaks)
