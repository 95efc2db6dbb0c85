"""Draft-model proposals (Leviathan et al. 2023; Chen et al. 2023).

A small model with the target's vocabulary guesses k tokens greedily; the
target verifies them all in one forward. Decoding is memory-bound, so the
target's cost barely grows with k + 1 query tokens, while the draft's k steps
are cheap because the draft is small.

The proposer lives in the runner, which calls it after sampling. The draft
keeps its own paged KV cache (the bookkeeping, and a pool of its own), keyed
by request id like the target's; the engine sizes it from the same KV memory
budget as the target's (``Engine``: the budget covers both). Each call runs,
for all requests at once:

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

import torch

from ..attention import get_attention_backend
from ..kv import KVPool, PagedKVCache
from .proposer import Proposer


class DraftModelProposer(Proposer):
    def __init__(self, draft_model, num_speculative_tokens: int, num_blocks: int, block_size: int = 16,
                 attention_backend: str = "auto", kv_cache_dtype: str = "auto"):
        super().__init__(num_speculative_tokens)
        self.model = draft_model
        self.device = draft_model.device
        # no prefix sharing and no forks: a block is never shared, so nothing is ever copied
        # the draft's cache is stored like the target's (kv_cache_dtype)
        self.kv_cache = PagedKVCache(draft_model.config, num_blocks, block_size, draft_model.dtype,
                                     enable_prefix_caching=False, watermark=0.0, kv_cache_dtype=kv_cache_dtype)
        self.kv_pool = KVPool.for_cache(self.kv_cache, draft_model.config, draft_model.dtype, self.device,
                                        kv_cache_dtype)
        self.attention = get_attention_backend(attention_backend, self.device)
        # request id -> (tokens fed before the last call's guesses, the guesses fed after them)
        self.fed: dict[str, tuple[int, list[int]]] = {}

    def _seen(self, s) -> int:
        """Tokens of ``s`` whose draft K/V is valid: those fed, then the fed
        guesses the target accepted (they now equal the request's tokens)."""
        n0, guesses = self.fed.get(s.request_id, (0, []))
        tokens = s.token_ids
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
    def propose(self, seqs):
        live, ids, pos, qlens, slens, ks = [], [], [], [], [], []
        for s in seqs:
            k, n = s.num_proposals, len(s.token_ids)
            if k == 0 or not self.kv_cache.allocate(s.request_id, n + k - 1):
                continue
            seen = self._seen(s)
            live.append(s)
            ks.append(k)
            ids += s.token_ids[seen:]
            pos += range(seen, n)
            qlens.append(n - seen)
            slens.append(n)
        self.last_draft_shapes = []
        if not live:
            return {}
        rids = [s.request_id for s in live]
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
        for s, g in zip(live, guesses):
            self.fed[s.request_id] = (len(s.token_ids), g[:-1])
        return dict(zip(rids, guesses))

    def free(self, request_id):
        self.fed.pop(request_id, None)
        if request_id in self.kv_cache.manager.block_tables:
            self.kv_cache.free(request_id)
