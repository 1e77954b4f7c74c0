"""What a drafter proposes for a round, and what a drafter is: the model, prompt lookup,
lookup with the model behind it, or the model through text."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np


class Draft(NamedTuple):
    """What a drafter proposes for one round."""

    tokens: list[int]
    probs: Sequence[np.ndarray] | None  # q per position (dense), when drafts were sampled
    reused: int = 0  # leading tokens drafted while the previous round was in flight

    def first(self, k: int) -> Draft:
        """Its first `k` tokens: a draft made ahead, for a round whose k changed since."""
        probs = None if self.probs is None else self.probs[:k]
        return Draft(self.tokens[:k], probs, min(k, self.reused))


class CandidateGenerator(Protocol):
    """Shaped like HF transformers' CandidateGenerator, without its learning hook: what a
    round's answer teaches (the next k) is the loop's DraftLength.

    Optional: `warm(prefill)` evaluates the prompt ahead of the first draft (the loop
    calls it while the verifier prefills); `likely_answers(committed, draft, limit)` ranks
    the verifier's likely answers to a draft (drafter/speculation.py)."""

    def get_candidates(
        self, committed: Sequence[int], k: int, stop: Callable[[], bool] | None = None
    ) -> Draft: ...
