"""Speculative decoding (chapter 9): propose k tokens cheaply, verify them in
the target's next forward, keep the accepted prefix plus one target token."""
from .draft import DraftModelProposer
from .ngram import NgramProposer, ngram_propose
from .proposer import ProposalInput, Proposer, SimProposer
from .verify import rejection_sample, verify_greedy

__all__ = ["Proposer", "ProposalInput", "NgramProposer", "DraftModelProposer", "SimProposer", "ngram_propose",
           "verify_greedy", "rejection_sample"]
