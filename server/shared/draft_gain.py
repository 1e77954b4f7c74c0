"""What a draft of k tokens is worth: a per-token acceptance, learned from rounds, and the
tokens a round of k drafts commits on average at it. One estimate for both sides: the
verifier's advice (server/verifier/decoding/advice.py) and the drafter's `auto` length
(drafter/length/draft_length.py).

A round of k drafts whose tokens are accepted one after another with probability a
commits on average

    E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (Leviathan et al., 2023). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

# Before any draft is seen: a = 0.75, as weak as one round.
PRIOR_ACCEPTED = 3.0
PRIOR_REJECTED = 1.0
ACCEPTANCE_DECAY = 0.9  # each round, the weight left to the rounds before it


@dataclass(frozen=True)
class Acceptance:
    """A per-token acceptance: accepted drafts against rejections, counted with weights
    that favour recent rounds."""

    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def after(
        self, drafted: int, accepted_prefix_len: int, decay: float = ACCEPTANCE_DECAY
    ) -> Acceptance:
        """The acceptance once a round of `drafted` tokens had `accepted_prefix_len` of
        them accepted (a round without a draft tells nothing)."""
        if drafted == 0:
            return self
        d = decay
        return Acceptance(
            d * self.accepted + accepted_prefix_len,
            d * self.rejected + (accepted_prefix_len < drafted),
        )


def expected_tokens(acceptance: float, k: int) -> float:
    """E(k): the tokens a round of k drafts commits on average."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)
