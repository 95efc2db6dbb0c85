"""Draft-model proposals (Leviathan et al. 2023; Chen et al. 2023).

A small model with the target's vocabulary guesses k tokens greedily; the
target verifies them all in one forward. Decoding is memory-bound, so the
target's cost barely grows with k + 1 query tokens, while the draft's k steps
are cheap because the draft is small.

The draft keeps its own paged KV cache (the bookkeeping, and a pool of its
own), keyed by request id like the target's. Each call runs, for all requests at once:

1. one ragged forward over the tokens the draft has not seen (the whole prompt
   the first time; afterwards the target's last token plus any accepted
   guesses that the draft had not fed itself), whose last logits give guess 1;
2. k - 1 one-token forwards, each feeding the previous guess.

Its K/V for guesses the target rejected is simply overwritten later: the
proposer remembers how many tokens it fed and which guesses it made, and after
verification only the accepted ones count as seen. Guesses are greedy, so as
proposals they are point masses (see :mod:`.verify`).
"""
from __future__ import annotations

import time

import torch

from ..attention import get_attention_backend
from ..kv import KVPool, PagedKVCache
from .proposer import Proposer


class DraftModelProposer(Proposer):
    def __init__(self, draft_model, num_speculative_tokens: int, num_blocks: int, block_size: int = 16,
                 attention_backend: str = "auto"):
        super().__init__(num_speculative_tokens)
        self.model = draft_model
        self.device = draft_model.device
        # no prefix sharing and no forks: a block is never shared, so nothing is ever copied
        self.kv_cache = PagedKVCache(draft_model.config, num_blocks, block_size, draft_model.dtype,
                                     enable_prefix_caching=False, watermark=0.0)
        self.kv_pool = KVPool.for_cache(self.kv_cache, draft_model.config, draft_model.dtype, self.device)
        self.attention = get_attention_backend(attention_backend, self.device)
        # request id -> (tokens fed before the last call's guesses, the guesses fed after them)
        self.fed: dict[str, tuple[int, list[int]]] = {}
        self.last_draft_s = 0.0

    def _seen(self, r) -> int:
        """Tokens of ``r`` whose draft K/V is valid: those fed, then the fed
        guesses the target accepted (they now equal the request's tokens)."""
        n0, guesses = self.fed.get(r.request_id, (0, []))
        tokens = r.all_token_ids
        seen = n0
        for g in guesses:
            if seen >= len(tokens) or tokens[seen] != g:
                break
            seen += 1
        return min(seen, len(tokens) - 1)       # the last token is always fed (its logits are needed)

    def _forward(self, ids, positions, query_lens, seq_lens, rids) -> list[int]:
        tables = [self.kv_cache.block_table(rid) for rid in rids]
        meta = self.attention.build_metadata(query_lens, seq_lens, tables, self.kv_cache.block_size,
                                             device=self.device)
        logits = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                            meta, self.kv_pool)
        return torch.argmax(logits, dim=-1).tolist()

    @torch.no_grad()
    def propose(self, requests):
        t0 = time.perf_counter()
        live, ids, pos, qlens, slens, ks = [], [], [], [], [], []
        for r in requests:
            k, n = self.num_proposals(r), r.num_tokens
            if k == 0 or not self.kv_cache.allocate(r.request_id, n + k - 1):
                continue
            seen = self._seen(r)
            live.append(r)
            ks.append(k)
            ids += r.all_token_ids[seen:]
            pos += range(seen, n)
            qlens.append(n - seen)
            slens.append(n)
        self.last_draft_shapes = []
        if not live:
            self.last_draft_s = time.perf_counter() - t0
            return {}
        rids = [r.request_id for r in live]
        self.last_draft_shapes.append(list(zip(qlens, slens)))
        guesses = [[t] for t in self._forward(ids, pos, qlens, slens, rids)]
        for j in range(1, max(ks)):
            idx = [i for i, k in enumerate(ks) if k > j]
            ctx = [slens[i] + j for i in idx]
            self.last_draft_shapes.append([(1, c) for c in ctx])
            nxt = self._forward([guesses[i][-1] for i in idx], [c - 1 for c in ctx], [1] * len(idx), ctx,
                                [rids[i] for i in idx])
            for i, t in zip(idx, nxt):
                guesses[i].append(t)
        for r, g in zip(live, guesses):
            self.fed[r.request_id] = (r.num_tokens, g[:-1])
        self.last_draft_s = time.perf_counter() - t0
        return dict(zip(rids, guesses))

    def free_except(self, live_ids):
        for rid in [rid for rid in self.fed if rid not in live_ids]:
            del self.fed[rid]
        for rid in [rid for rid in self.kv_cache.manager.block_tables if rid not in live_ids]:
            self.kv_cache.free(rid)
