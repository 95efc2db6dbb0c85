"""ModelRunner: turns a SchedulerOutput into tensors and runs the real model.

It owns the KV pool (:class:`~minibatch_engine.kv.KVPool`) and, for swap
preemption, its host pool: every byte of K/V that moves is moved here. Each
step first carries out the block copies the scheduler decided (copy-on-write,
swap-out, swap-in), in their order, then the forward writes the new tokens'
K/V. Per step it builds, on the host, the flat ``input_ids`` and ``positions`` of
every new token and the attention metadata of its attention backend (lengths,
block tables, ``slot_mapping``; see :mod:`minibatch_engine.attention`), copies
them to the model's device once, runs one forward
over the whole ragged batch and samples. The only device-to-host copy is the
sampled token ids, which the scheduler needs.

The runner owns the sampling state: one ``torch.Generator`` per seeded request,
keyed by request id and dropped when the scheduler reports the request
finished, so a seeded request draws the same tokens whatever it is batched
with. It never sees a request: the SchedulerOutput carries the token ids,
positions, block tables and sampling parameters it needs, and for structured
output the step's grammar bitmask, which sets the forbidden tokens' logits to
``-inf`` before sampling (the log-probabilities stay the raw model's).

The runner keeps a persistent batch (:mod:`.input_batch`, vLLM V1's
``InputBatch``): its own record of each running request's tokens,
``num_computed_tokens``, block-table row and sampling parameters. Each
``SchedulerOutput`` updates the record (admitted requests enter, ended and
preempted ones leave, running ones take their new tokens and blocks), and the
step's inputs are built from it. With speculative decoding (chapter 9) the
runner also holds the proposer, with a draft model's KV cache. After sampling
it hands the proposer each request's tokens from the record, and the guesses
go back in the ``RunnerOutput`` (vLLM V1's shape: the drafter runs in the
worker, after sampling).

On CUDA with the ``"triton"`` backend, decode-only steps replay a CUDA graph
(:mod:`.cuda_graphs`) instead of launching every kernel from Python; the
switch is ``EngineConfig.cuda_graphs``. On a CPU the model's linear layers are
switched to prepacked weights where that measures faster (:mod:`.prepack`),
and a step runs as a flat loop of kernel calls where it can
(:mod:`.flat_forward`): the runner changes how the model it is given
multiplies and how its kernels are called, never what it computes beyond
float rounding. It also keeps the memory a CPU step frees for the next one
(:mod:`.cpu_memory`: glibc's malloc thresholds, once per process).
"""
from __future__ import annotations

import time

import torch

from ..attention import get_attention_backend
from ..attention.metadata import long_tensor
from ..model.config import PAD_ID
from ..model.transformer import Transformer
from ..sampling.logits_process import apply_logits_processors, needs_history, needs_processing
from ..sampling.logprobs import token_logprobs, wide
from ..sampling.sampler import sample, sampling_probs
from ..core.outputs import RunnerOutput, SchedulerOutput
from ..speculative.proposer import Proposer
from ..speculative.verify import rejection_sample, verify_greedy
from ..sampling.structured_output import apply_bitmask
from ..kv.pool import carry_out
from .base import Runner
from .input_batch import InputBatch
from .cpu_memory import keep_freed_memory
from .cpu_threads import LoadFollower, set_cpu_threads, thread_ceiling
from .flat_forward import FlatForward
from .prepack import prepack_linear_weights


class ModelRunner(Runner):
    def __init__(self, model, kv_pool, host_pool=None, pad_token_id: int | None = None,
                 attention_backend: str = "auto", cuda_graphs: bool = False, max_num_seqs: int = 256,
                 max_model_len: int | None = None, proposer: Proposer | None = None,
                 cpu_threads: int | str = "auto", cpu_threads_follow_load: bool = True):
        self.model, self.kv_pool, self.host_pool = model, kv_pool, host_pool
        self.proposer = proposer
        self.input_batch = InputBatch()                # the persistent batch: each running request's record
        self.device = model.device
        self.attention = get_attention_backend(attention_backend, self.device)
        self.pad_token_id = PAD_ID if pad_token_id is None else pad_token_id
        if self.pad_token_id >= model.config.vocab_size:
            self.pad_token_id = 0
        # Decode steps replay CUDA graphs where they can: CUDA, and metadata of static shape (triton).
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda" and self.attention.name == "triton":
            from .cuda_graphs import DecodeGraphs
            self.graphs = DecodeGraphs(model, kv_pool, self.attention, max_num_seqs,
                                       max_model_len or model.config.max_position, self.pad_token_id)
        self.load_follower = None      # re-decides the CPU threads as other processes come and go
        self.flat = None               # the forward as a flat loop of CPU kernel calls, where it applies
        if self.device.type == "cpu":
            keep_freed_memory()          # a step reuses the pages the step before freed
            set_cpu_threads(cpu_threads, cpu_threads_follow_load)   # before prepacking times them
            prepack_linear_weights(model)
            if isinstance(model, Transformer):
                self.flat = FlatForward(model, kv_pool)
            if cpu_threads_follow_load and thread_ceiling(cpu_threads) > 1:   # one thread: nothing to follow
                self.load_follower = LoadFollower(thread_ceiling(cpu_threads))
        self.generators: dict[str, torch.Generator] = {}   # request id -> its sampling RNG
        self.eos_token_id: int | None = None                # min_tokens holds EOS back (set by the engine)
        # prompt logprobs under chunked prefill: request id -> (position, log-softmax row) of the
        # chunk's last row, which scores the next chunk's first token
        self.pending_prompt_rows: dict[str, tuple[int, torch.Tensor]] = {}

    @staticmethod
    def _wants_prompt_rows(s) -> bool:
        """A prompt chunk of a request asking for prompt log-probabilities: every row's logits."""
        return s.sampling_params.prompt_logprobs is not None and s.start < s.num_prompt_tokens \
            and not s.spec_token_ids

    def rows_per_seq(self, sched: SchedulerOutput) -> list[int]:
        """Rows of logits each scheduled sequence gets: 1 (its last token), k + 1
        (verifying k proposals), or every token of a prompt chunk whose prompt
        log-probabilities are asked for."""
        return [s.num_spec_tokens + 1 if s.spec_token_ids else
                s.num_tokens if self._wants_prompt_rows(s) else 1 for s in sched.scheduled]

    def prepare_inputs(self, sched: SchedulerOutput):
        """(input_ids, positions, attention metadata) of the step, on the device.

        Each scheduled request's tokens, positions and block table come from
        the persistent batch (updated from ``sched`` first), its proposals from
        ``sched``. The metadata's ``logits_indices`` select one row per sequence
        (its last token), and for a request verifying k proposed tokens the
        k + 1 rows of its last known token and its proposals, in the scheduled
        order."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        logits_rows: list[int] = []
        counts = self.rows_per_seq(sched)
        spec = any(c > 1 for c in counts)        # some sequence needs more than its last row
        for s, c in zip(sched.scheduled, counts):
            state = self.input_batch[s.request_id]
            n, start = s.num_tokens, state.num_computed_tokens
            if spec:
                end = len(ids) + n
                logits_rows += range(end - c, end)
            if n == 1:                               # a decode: its one known token
                ids.append(state.token_ids[start])
                positions.append(start)
            else:
                ids += state.token_ids[start:start + n - s.num_spec_tokens]
                ids += s.spec_token_ids
                positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(state.block_table)
        null, block_size = self.kv_pool.null_block, self.kv_pool.block_size
        for p in sched.padding:
            logits_rows.append(len(ids) + p.num_tokens - 1)
            ids += [self.pad_token_id] * p.num_tokens
            positions += range(p.start, p.start + p.num_tokens)
            query_lens.append(p.num_tokens)
            seq_lens.append(p.start + p.num_tokens)
            n_blocks = -(-(p.start + p.num_tokens) // block_size)
            tables.append(p.block_table if p.block_table is not None else [null] * n_blocks)
        meta = self.attention.build_metadata(query_lens, seq_lens, tables, block_size, device=self.device)
        if spec:
            meta.logits_indices = long_tensor(logits_rows).to(self.device)
        input_ids = long_tensor(ids).to(self.device, non_blocking=True)
        return input_ids, long_tensor(positions).to(self.device, non_blocking=True), meta

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _generator(self, request_id: str, params) -> torch.Generator | None:
        """The request's own RNG, created from its seed on first use (None: unseeded)."""
        if params.seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return gen

    @torch.no_grad()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.input_batch.update(sched)             # the persistent batch follows the schedule
        for rid in sched.finished_request_ids:
            self.generators.pop(rid, None)
            self.pending_prompt_rows.pop(rid, None)
            if self.proposer is not None:
                self.proposer.free(rid)
        for p in sched.preempted:
            self.pending_prompt_rows.pop(p.request_id, None)
        if self.proposer is not None:
            for p in sched.preempted:               # its KV is gone: so is the draft's
                self.proposer.free(p.request_id)
        out = RunnerOutput()
        if self.load_follower is not None:
            self.load_follower.poll()
        if sched.block_copies:
            carry_out(sched.block_copies, self.kv_pool, self.host_pool)
        if sched.is_empty:
            return out
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.can_run(sched):
            rows = [self.input_batch[s.request_id] for s in sched.scheduled]
            logits = self.graphs.run([r.token_ids[r.num_computed_tokens] for r in rows],
                                     [r.num_computed_tokens + 1 for r in rows], [r.block_table for r in rows])
        else:
            input_ids, positions, meta = self.prepare_inputs(sched)
            out.prepare_s = time.perf_counter() - t0
            t0 += out.prepare_s
            if self.flat is not None and self.flat.can_run(input_ids.shape[0], meta):
                logits = self.flat(input_ids, positions, meta)    # the same kernels, less Python
            else:
                logits = self.model(input_ids, positions, meta, self.kv_pool)
        self._sync()
        t1 = time.perf_counter()
        # One row of the step's logits per sampling request; the samples forked
        # from an n > 1 request draw from their parent's row. A request with
        # proposals has k + 1 rows and is verified instead. A request whose
        # sampling fails is reported in out.errors; the others are unaffected.
        rows, seqs, row = [], [], 0
        for s, c in zip(sched.scheduled, self.rows_per_seq(sched)):
            if s.spec_token_ids:
                try:
                    out.sampled_token_ids[s.request_id] = self._verify(s, logits[row:row + c])
                except (RuntimeError, ValueError) as e:
                    out.errors[s.request_id] = f"verification failed: {e}"
            else:
                if c > 1 or s.request_id in self.pending_prompt_rows:
                    self._prompt_logprobs(s, logits[row:row + c], out)
                if s.samples_token:
                    rows.append(row + c - 1)
                    seqs.append((s.request_id, s.sampling_params))
                    for fork in s.forks:
                        rows.append(row + c - 1)
                        seqs.append((fork.request_id, fork.sampling_params))
            row += c
        if rows:
            gens = []
            for rid, params in seqs:
                try:
                    gens.append(self._generator(rid, params))
                except (RuntimeError, ValueError) as e:
                    gens.append(None)
                    out.errors[rid] = f"its seed could not start a generator: {e}"
            # Every row in order, once each (no forks, no proposals): sample the logits as they are.
            every_row = rows == list(range(logits.shape[0]))
            errors: dict[int, str] = {}
            params = [p for _, p in seqs]
            raw = logits if every_row else logits[rows]
            picked = raw
            if any(needs_processing(p) for p in params):
                picked = apply_logits_processors(raw, params, self._histories(sched, seqs),
                                                 self._num_prompt(sched, seqs), self.eos_token_id)
            if sched.grammar is not None:               # structured output: -inf where the grammar says no
                which = sched.grammar.rows              # sequence id -> its row of the bitmask
                masked = [i for i, (rid, _) in enumerate(seqs) if rid in which]
                picked = apply_bitmask(picked, sched.grammar.bitmask, masked, [which[seqs[i][0]] for i in masked])
            tokens = sample(picked, params, gens, errors).tolist()
            for i, ((rid, _), t) in enumerate(zip(seqs, tokens)):
                if i in errors:
                    out.errors.setdefault(rid, errors[i])
                elif rid not in out.errors:
                    out.sampled_token_ids[rid] = [t]
            want = [i for i, p in enumerate(params) if p.logprobs is not None and seqs[i][0] in out.sampled_token_ids]
            if want:                                    # from the raw distribution (module doc of logprobs)
                entries = token_logprobs(raw[want], [tokens[i] for i in want], [params[i].logprobs for i in want])
                for i, e in zip(want, entries):
                    out.logprobs[seqs[i][0]] = [e]
        self._record_sampled(sched, out)
        t2 = time.perf_counter()
        out.forward_s, out.sample_s = t1 - t0, t2 - t1
        if self.proposer is not None:
            self._propose(sched, out)
            out.draft_s = time.perf_counter() - t2
        return out

    def _histories(self, sched: SchedulerOutput, seqs) -> list:
        """Each sampled sequence's tokens so far (None where its processors need
        none); a fork sampling for the first time has its parent's."""
        parent = {f.request_id: s.request_id for s in sched.scheduled for f in s.forks}
        batch = self.input_batch
        return [batch.token_ids(parent.get(rid, rid)) if needs_history(p) else None for rid, p in seqs]

    @staticmethod
    def _num_prompt(sched: SchedulerOutput, seqs) -> list[int]:
        n = {s.request_id: s.num_prompt_tokens for s in sched.scheduled}
        n.update({f.request_id: s.num_prompt_tokens for s in sched.scheduled for f in s.forks})
        return [n[rid] for rid, _ in seqs]

    def _record_sampled(self, sched: SchedulerOutput, out: RunnerOutput) -> None:
        """Add the step's sampled tokens to the persistent batch; a forked sample
        enters it as its parent's tokens plus its own first one."""
        sampled, batch = out.sampled_token_ids, self.input_batch
        for s in sched.scheduled:
            if not s.samples_token:
                continue
            for f in s.forks:
                if f.request_id in sampled:
                    batch.fork(s.request_id, f.request_id, f.sampling_params, sampled[f.request_id])
            if s.request_id in sampled:
                batch.append_sampled(s.request_id, sampled[s.request_id])

    def _prompt_logprobs(self, s, logits: torch.Tensor, out: RunnerOutput) -> None:
        """Prompt log-probabilities this chunk settles (:mod:`minibatch_engine.sampling.logprobs`):
        the row of position p scores the token at p + 1; the chunk's last row
        waits for the next chunk's first token, unless the prompt ends here."""
        P, known = s.num_prompt_tokens, s.token_ids
        lp = torch.log_softmax(wide(logits), dim=-1)
        pending = self.pending_prompt_rows.pop(s.request_id, None)
        rows, targets, first = [], [], s.start + 1
        if pending is not None and pending[0] == s.start:
            rows.append(pending[1][None])
            targets.append(known[0])
            first = s.start
        whole = len(lp) == len(known)                # every row of the chunk is here
        m = max(0, min(len(known) - 1, P - s.start - 1)) if whole else 0
        if m:
            rows.append(lp[:m])
            targets += known[1:m + 1]
        if whole and s.start + len(known) < P:
            self.pending_prompt_rows[s.request_id] = (s.start + len(known), lp[-1])
        if targets:
            n = s.sampling_params.prompt_logprobs
            out.prompt_logprobs[s.request_id] = (first, token_logprobs(torch.cat(rows), targets,
                                                                       [n] * len(targets), normalised=True))

    def _propose(self, sched: SchedulerOutput, out: RunnerOutput) -> None:
        """After sampling: the proposer's guesses for every sequence that sampled
        (forks included), from its tokens in the persistent batch."""
        sampled, batch, seqs = out.sampled_token_ids, self.input_batch, []
        for s in sched.scheduled:
            if not s.samples_token:
                continue
            for rid in [f.request_id for f in s.forks] + [s.request_id]:
                state = batch.get(rid) if rid in sampled else None
                if state is not None and speculable(state.sampling_params):
                    seqs.append(self.proposer.input_for(rid, len(state.token_ids), state.num_prompt_tokens,
                                                        state.sampling_params, state.token_ids))
        out.spec_token_ids = self.proposer.propose(seqs)
        out.draft_shapes = self.proposer.last_draft_shapes

    def _verify(self, s, logits: torch.Tensor) -> list[int]:
        """Accepted proposals plus one token from the target (chapter 9)."""
        p = s.sampling_params
        if p.greedy:
            return verify_greedy(torch.argmax(logits, dim=-1).tolist(), s.spec_token_ids)
        probs = sampling_probs(logits, [p] * logits.shape[0])
        return rejection_sample(probs, s.spec_token_ids, generator=self._generator(s.request_id, p))


def speculable(params) -> bool:
    """Requests whose logits are processed, whose log-probabilities are asked
    for, or whose output follows a grammar (structured output) are not
    speculated: they decode one token per step, sampled as without speculation
    (verification samples from temperature, top-k and top-p only, and
    proposals are not checked against a grammar)."""
    return params.logprobs is None and not needs_processing(params) and params.structured_outputs is None

