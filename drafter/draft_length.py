"""How many tokens to draft next round: fixed, or learned from the session's acceptance.

The adaptive rule is HF transformers' "heuristic" schedule (AssistedCandidateGenerator):
every draft accepted whole earns two more tokens next round, any rejection costs one.
Measured here against confidence cut-offs (llama.cpp's p_min, fixed at 0.5 and 0.75, and
one whose threshold followed the session's measured costs): on this project's CPU pair
the schedule held up best across network delays; see the README's Performance section.

Prompt lookup drafts cost nothing to make and are all or nothing: a copied span runs on
for dozens of tokens, then breaks off. `DoublingLength` follows that: it doubles after a
whole draft was accepted and falls to one past what was accepted after a rejection. It is
what `auto` means for the n-gram drafter (measured in the README against HF's schedule).
Pure: no model, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedLength:
    k: int

    def next(self) -> int:
        return self.k

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        pass

    @property
    def label(self) -> str:
        return str(self.k)


@dataclass
class AdaptiveLength:
    """+2 after a round whose whole draft was accepted, -1 after a rejection, within
    [minimum, maximum]. Starts at `start`."""

    maximum: int
    start: int = 4
    minimum: int = 1
    grow: int = 2
    shrink: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.minimum <= self.maximum:
            raise ValueError("need 0 <= minimum <= maximum")
        self.k = min(max(self.start, self.minimum), self.maximum)

    def next(self) -> int:
        return self.k

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        if drafted == 0:
            return  # nothing learned (a round cut short by max_tokens or the context)
        if accepted_prefix_len == drafted:
            self.k = min(self.k + self.grow, self.maximum)
        else:
            self.k = max(self.k - self.shrink, self.minimum)

    @property
    def label(self) -> str:
        return "auto"


@dataclass
class DoublingLength:
    """x2 after a round whose whole draft was accepted; after a rejection, the accepted
    prefix plus one. Within [minimum, maximum], starting at `start`."""

    maximum: int
    start: int = 4
    minimum: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError("need 1 <= minimum <= maximum")
        self.k = min(max(self.start, self.minimum), self.maximum)

    def next(self) -> int:
        return self.k

    def update(self, drafted: int, accepted_prefix_len: int) -> None:
        if drafted == 0:
            return  # no match, or a round cut short: nothing learned
        if accepted_prefix_len == drafted:
            self.k = min(2 * self.k, self.maximum)
        else:
            self.k = min(max(accepted_prefix_len + 1, self.minimum), self.maximum)

    @property
    def label(self) -> str:
        return "auto"


DraftLength = FixedLength | AdaptiveLength | DoublingLength


def parse_draft_n(value: str) -> int | None:
    """'auto' -> None (adaptive), else a non-negative int. Raises ValueError."""
    if value.strip().lower() == "auto":
        return None
    k = int(value)
    if k < 0:
        raise ValueError("--draft-n must be >= 0 or 'auto'")
    return k
