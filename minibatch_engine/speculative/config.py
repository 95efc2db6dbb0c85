"""Speculative decoding's knobs (chapter 9), validated here (composed by
``EngineConfig``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..core.checks import is_int
from ..model.config import ModelConfig, get_preset

SPEC_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (chapter 9): guess ``num_speculative_tokens`` (k) tokens
    per decoding request cheaply, verify them in the target's next forward.

    method: ``"ngram"`` (prompt lookup: the k tokens that followed the latest
        earlier occurrence of the request's last n tokens, n tried from
        ``prompt_lookup_max`` down to ``prompt_lookup_min``) or ``"draft_model"``
        (a small model with the same vocabulary runs k greedy steps).
    draft_model: for ``"draft_model"``: a Transformer, ``"tiny"`` or a checkpoint
        directory (loaded on the target's device and dtype).
    sim_acceptance_rate: simulator only (no model): each proposed token is
        accepted with this probability, in order, until the first rejection (a
        seeded Bernoulli: an assumption, since acceptance depends on the text).
    sim_draft_model: simulator only: the preset whose roofline prices the
        draft's k steps (``"draft_model"``; default ``"llama-3.2-1b"``).
    seed: seeds the simulator's acceptance draws.

    Greedy requests give the same tokens with and without speculation. A seeded
    sampled request does not: rejection sampling consumes its generator
    differently, so it keeps the output's distribution, not the draws.
    """
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    draft_model: object = None
    sim_acceptance_rate: float = 0.7
    sim_draft_model: str | ModelConfig | None = None
    seed: int = 0

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method={self.method!r} is not one of "
                             f"{', '.join(map(repr, SPEC_METHODS))}")
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1),
                          ("seed", 0)):
            v = getattr(self, name)
            if not is_int(v) or v < low:
                raise ValueError(f"speculative {name} must be an integer >= {low}, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        a = self.sim_acceptance_rate
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"speculative sim_acceptance_rate must be a number in [0, 1], got {a!r}")
        if self.method != "draft_model" and self.draft_model is not None:
            raise ValueError("draft_model is only used with method='draft_model'")
        if isinstance(self.sim_draft_model, str):
            get_preset(self.sim_draft_model)
        elif self.sim_draft_model is not None and not isinstance(self.sim_draft_model, ModelConfig):
            raise ValueError(f"sim_draft_model must be a preset name or a ModelConfig, got {self.sim_draft_model!r}")
