"""N-gram proposals (prompt lookup decoding, Saxena 2023): no model at all.

Text often repeats itself: code reuses names, a summary quotes its source, a
chat answer echoes the question. Take the request's last n tokens, find the
latest earlier place where the same n tokens occur in its own prompt and
output, and propose the k tokens that followed them there. Longer matches are
tried first (n from ``max_n`` down to ``min_n``). A request with no match gets
no proposal and decodes one token as usual.

Proposals cost a scan of the request's tokens on the host, no forward pass: a
miss is free, and a hit on repetitive text gives several tokens per step.
"""
from __future__ import annotations

from typing import Sequence

from .proposer import Proposer


def ngram_propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of the last n tokens
    (the longest n in ``max_n .. min_n`` that matches), or [] if none does."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        pattern = list(tokens[L - n:])
        for i in range(L - n - 1, -1, -1):          # latest occurrence first, ending before the last token
            if tokens[i] == pattern[0] and list(tokens[i:i + n]) == pattern:
                return list(tokens[i + n:i + n + k])
    return []


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3):
        super().__init__(num_speculative_tokens)
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs):
        out = {}
        for s in seqs:
            guess = ngram_propose(s.token_ids, s.num_proposals, self.min_n, self.max_n) if s.num_proposals else []
            if guess:
                out[s.request_id] = guess
        return out
